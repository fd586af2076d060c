# export -> provenance: verified Hugging Face safetensors, then the run record.


rule export:
    input:
        CHAIN.train.record,
    output:
        directory(CHAIN.export.path),
    log:
        CHAIN.log("export"),
    benchmark:
        CHAIN.benchmark("export")
    container:
        image
    resources:
        # --verify-logits runs both models on the accelerator when there is one
        accelerator_jobs=1,
    params:
        checkpoints=lambda wc: ChainDir.of(wc.recipe).train.checkpoints,
        flags=export_flags,
        python=python(),
    shell:
        "{params.python} -m engine export {params.checkpoints} --out {output} {params.flags} > {log} 2>&1"


rule provenance:
    input:
        run=CHAIN.train.record,
        export=CHAIN.export.path,
        manifest=CHAIN.manifest,
        train=CHAIN.split("train"),
        test=CHAIN.split("test"),
        smoke=CHAIN.smoke.record,
    output:
        record=CHAIN.train.provenance,
        crate=CHAIN.train.crate,
    log:
        CHAIN.log("provenance"),
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
