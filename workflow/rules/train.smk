# smoke -> train: the same recipe, model and parallel plan; the smoke gates the full run.


rule smoke:
    input:
        manifest=CHAIN.manifest,
        model=model_inputs,
    output:
        CHAIN.smoke.record,
    log:
        CHAIN.log("smoke"),
    benchmark:
        CHAIN.benchmark("smoke")
    container:
        image
    resources:
        nodes=resource("nodes"),
        tasks=resource("tasks"),
        mpi=resource("mpi"),
        cpus_per_task=resource("cpus_per_task"),
        gres=resource("gres"),
        tasks_per_gpu=resource("tasks_per_gpu"),
        # one training launch at a time where the jobs share a machine (`--resources accelerator_jobs=1`)
        accelerator_jobs=1,
    params:
        # a smoke always starts from scratch: a stale checkpoint would make it skip training. Its own
        # checkpoint only shows that saving works; it goes once the smoke passed, so the disk holds one
        # run's checkpoint (25 GB for the 35B-A3B rehearsal on a 64 GB disk), not two
        rundir=subpath(output[0], parent=True),
        launch=lambda wc: launch_command(wc.recipe, "smoke"),
        failed=keep_failed_record,
    shell:
        "rm -rf {params.rundir}/checkpoints; "
        "{params.launch} > {log} 2>&1 || {params.failed}; "
        "rm -rf {params.rundir}/checkpoints"


rule train:
    input:
        smoke=CHAIN.smoke.record,
        manifest=CHAIN.manifest,
        model=model_inputs,
    output:
        # only the record: the checkpoints beside it must survive a failed attempt (resume)
        CHAIN.train.record,
    log:
        CHAIN.log("train"),
    benchmark:
        CHAIN.benchmark("train")
    container:
        image
    resources:
        nodes=resource("nodes"),
        tasks=resource("tasks"),
        mpi=resource("mpi"),
        cpus_per_task=resource("cpus_per_task"),
        gres=resource("gres"),
        tasks_per_gpu=resource("tasks_per_gpu"),
        accelerator_jobs=1,
    params:
        rundir=subpath(output[0], parent=True),
        launch=lambda wc: launch_command(wc.recipe, "train"),
        failed=keep_failed_record,
        metrics=lambda wc: ChainDir.of(wc.recipe).train.metrics,
        earlier=lambda wc: ChainDir.of(wc.recipe).train.earlier_metrics,
        python=python(),
    shell:
        # a resumed attempt starts a new metrics.jsonl: keep the earlier steps for the curves
        "if [ -s {params.metrics} ]; then cat {params.metrics} >> {params.earlier}; fi; "
        "{params.launch} >> {log} 2>&1 || {params.failed}; "
        "{params.python} workflow/scripts/check_trained.py {params.rundir} >> {log} 2>&1"


# The negative control (--config control=no_weight_sync): the same run with its loop broken on purpose.
# It succeeds only when the gate that must catch the breakage fails (`engine run --control`): a gate that
# never failed on a broken loop proves nothing about a healthy one. No checkpoint is kept.
rule control:
    input:
        smoke=CHAIN.smoke.record,
        manifest=CHAIN.manifest,
        model=model_inputs,
    output:
        CHAIN.control.record,
    log:
        CHAIN.log("control"),
    benchmark:
        CHAIN.benchmark("control")
    container:
        image
    resources:
        nodes=resource("nodes"),
        tasks=resource("tasks"),
        mpi=resource("mpi"),
        cpus_per_task=resource("cpus_per_task"),
        gres=resource("gres"),
        tasks_per_gpu=resource("tasks_per_gpu"),
        accelerator_jobs=1,
    params:
        launch=lambda wc: launch_command(wc.recipe, "control"),
        failed=keep_failed_record,
    shell:
        "{params.launch} > {log} 2>&1 || {params.failed}"
