# smoke -> train: the same recipe, model and parallel plan; the smoke gates the full run.


rule smoke:
    input:
        unpack(lambda wc: {"manifest": f"results/{wc.recipe}/data/manifest.json"}),
        model_inputs,
    output:
        "results/{recipe}/smoke/run.json",
    log:
        "results/{recipe}/logs/smoke.log",
    benchmark:
        "results/{recipe}/benchmarks/smoke.tsv"
    container:
        image
    resources:
        nodes=resource("nodes"),
        tasks=resource("tasks"),
        mpi=resource("mpi"),
        cpus_per_task=resource("cpus_per_task"),
        gres=resource("gres"),
        tasks_per_gpu=resource("tasks_per_gpu"),
    params:
        # a smoke always starts from scratch: a stale checkpoint would make it skip training
        rundir=subpath(output[0], parent=True),
        launch=lambda wc: launch_command(wc.recipe, "smoke"),
    shell:
        "rm -rf {params.rundir}/checkpoints && {params.launch} > {log} 2>&1"


rule train:
    input:
        smoke="results/{recipe}/smoke/run.json",
        manifest="results/{recipe}/data/manifest.json",
        model=model_inputs,
    output:
        # only the record: the checkpoints beside it must survive a failed attempt (resume)
        "results/{recipe}/train/run.json",
    log:
        "results/{recipe}/logs/train.log",
    benchmark:
        "results/{recipe}/benchmarks/train.tsv"
    container:
        image
    resources:
        nodes=resource("nodes"),
        tasks=resource("tasks"),
        mpi=resource("mpi"),
        cpus_per_task=resource("cpus_per_task"),
        gres=resource("gres"),
        tasks_per_gpu=resource("tasks_per_gpu"),
    params:
        rundir=subpath(output[0], parent=True),
        launch=lambda wc: launch_command(wc.recipe, "train"),
        python=python(),
    shell:
        # a resumed attempt starts a new metrics.jsonl: keep the earlier steps for the curves
        "if [ -s {params.rundir}/metrics.jsonl ]; then "
        "cat {params.rundir}/metrics.jsonl >> {params.rundir}/metrics.earlier.jsonl; fi; "
        "{params.launch} >> {log} 2>&1 && "
        "{params.python} workflow/scripts/check_trained.py {params.rundir} >> {log} 2>&1"
