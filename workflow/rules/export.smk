# export -> provenance: verified Hugging Face safetensors, then the run record.


rule export:
    input:
        "results/{recipe}/train/run.json",
    output:
        directory("results/{recipe}/export"),
    log:
        "results/{recipe}/logs/export.log",
    benchmark:
        "results/{recipe}/benchmarks/export.tsv"
    container:
        image
    resources:
        # --verify-logits runs both models on the accelerator when there is one
        accelerator_jobs=1,
    params:
        checkpoints=lambda wc: f"results/{wc.recipe}/train/checkpoints",
        flags=export_flags,
        python=python(),
    shell:
        "{params.python} -m engine export {params.checkpoints} --out {output} {params.flags} > {log} 2>&1"


rule provenance:
    input:
        run="results/{recipe}/train/run.json",
        export="results/{recipe}/export",
        manifest="results/{recipe}/data/manifest.json",
        train="results/{recipe}/data/train.parquet",
        test="results/{recipe}/data/test.parquet",
        smoke="results/{recipe}/smoke/run.json",
    output:
        record="results/{recipe}/train/provenance.json",
        crate="results/{recipe}/train/ro-crate-metadata.json",
    log:
        "results/{recipe}/logs/provenance.log",
    container:
        image
    params:
        rundir=subpath(input.run, parent=True),
        python=python(),
        # every step of the chain goes into the record (data/, smoke/, train/, export/)
        snakefile=workflow.main_snakefile,
    shell:
        "{params.python} -m engine provenance write {params.rundir} --export {input.export} "
        "--workflow {params.snakefile} > {log} 2>&1"
