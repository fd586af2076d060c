# Reward, loss and rollout/actor gap curves from verl's metrics JSONL, for `snakemake --report`.


rule plot_curves:
    input:
        "results/{recipe}/train/run.json",
    output:
        report(
            "results/{recipe}/report/curves.png",
            caption="../report/curves.rst",
            category="Training",
            subcategory="{recipe}",
        ),
    log:
        "results/{recipe}/logs/plot_curves.log",
    container:
        image
    params:
        # earlier attempts of a resumed run first, so the latest value of a step wins
        metrics=lambda wc: [
            f"results/{wc.recipe}/train/metrics.earlier.jsonl",
            f"results/{wc.recipe}/train/metrics.jsonl",
        ],
        # the agreement gate's threshold is drawn on the gap panel
        device=lambda wc: resolved(wc.recipe)[1],
    script:
        "../scripts/plot_curves.py"


# Accelerator runs: the gates again with the smoke thresholds, the step-time split (generation, log-probs,
# update, weight sync), rollout tokens/s and the trainer's peak memory, from verl's metrics.
rule run_report:
    input:
        run="results/{recipe}/train/run.json",
        export="results/{recipe}/export",
    output:
        "results/{recipe}/train/smoke_report.json",
    log:
        "results/{recipe}/logs/run_report.log",
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
