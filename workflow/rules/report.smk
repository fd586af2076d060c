# Reward, loss and rollout/actor gap curves from verl's metrics JSONL, for `snakemake --report`.


rule plot_curves:
    input:
        CHAIN.train.record,
    output:
        report(
            CHAIN.curves,
            caption="../report/curves.rst",
            category="Training",
            subcategory="{recipe}",
        ),
    log:
        CHAIN.log("plot_curves"),
    container:
        image
    params:
        # earlier attempts of a resumed run first, so the latest value of a step wins
        metrics=lambda wc: [
            ChainDir.of(wc.recipe).train.earlier_metrics,
            ChainDir.of(wc.recipe).train.metrics,
        ],
        # the agreement gate's threshold is drawn on the gap panel
        device=lambda wc: resolved(wc.recipe)[1],
    script:
        "../scripts/plot_curves.py"


# Accelerator runs: the gates again with the smoke thresholds, the step-time split (generation, log-probs,
# update, weight sync), rollout tokens/s and the trainer's peak memory, from verl's metrics.
rule run_report:
    input:
        run=CHAIN.train.record,
        export=CHAIN.export.path,
    output:
        CHAIN.train.run_report,
    log:
        CHAIN.log("run_report"),
    container:
        image
    resources:
        accelerator_jobs=1,
    params:
        rundir=subpath(input.run, parent=True),
        drift=drift_flags,
        python=python(),
    shell:
        "{params.python} -m engine smoke-report {params.rundir} {params.drift} > {log} 2>&1"
