# Trainer benchmarks on one GPU (docs/reference/trainer-levers.md): each trainer lever's own effect on the
# 35B-A3B architecture at 6 layers and on the dense 0.8B beside plain FSDP2, packing on the MoE, the
# levers' numerics through verl's engine, each stage compared with its regression baseline, and the
# GRPO step with the hf rollout against verl's vLLM rollout.
#   snakemake --profile profiles/h200 bench_levers --config 'bench_stages=[moe]'


rule bench_trainer:
    input:
        model=lambda wc: str(
            models_dir() / config["bench"]["stages"][wc.stage]["model"]
        ),
    output:
        BENCH / "{stage}.jsonl",
    log:
        BENCH / "logs" / "{stage}.log",
    container:
        gpu_image
    resources:
        accelerator_jobs=1,
    params:
        args=lambda wc: bench_args(wc.stage),
        kept=failed_rows,
        failed=keep_failed_rows,
        python=python(),
    shell:
        # a group that fails (a crash, a timeout) fails the job: the rows of the groups that measured are
        # kept beside the log with the failed group's error row
        "rm -f {params.kept}; "
        "{params.python} -m benchmarks.gpu_bench run --model {input.model} {params.args} --out {output} "
        "> {log} 2>&1 || {params.failed}"


rule trainer_numerics:
    input:
        model=str(models_dir() / config["bench"]["numerics"]["model"]),
    output:
        BENCH / "numerics.jsonl",
    log:
        BENCH / "logs" / "numerics.log",
    container:
        gpu_image
    resources:
        accelerator_jobs=1,
    params:
        seq=config["bench"]["numerics"]["seq"],
        lr=config["bench"]["numerics"]["lr"],
        levers=numerics_levers,
        kept=failed_rows,
        failed=keep_failed_rows,
        python=python(),
    shell:
        # a lever out of its tolerance fails the job: the rows that show why are kept beside the log
        "rm -f {params.kept}; "
        "{params.python} -m benchmarks.trainer_numerics --model {input.model} --seq {params.seq} "
        "--lr {params.lr} {params.levers}--out {output} > {log} 2>&1 || {params.failed}"


# torch_varlen (the varlen-attn lever) against transformers' masked SDPA: a difference beyond the
# check's tolerance fails the job, whose row stays in the log
rule attention_check:
    input:
        model=str(models_dir() / config["bench"]["attention"]["model"]),
    output:
        BENCH / "attention-check.jsonl",
    log:
        BENCH / "logs" / "attention-check.log",
    container:
        gpu_image
    resources:
        accelerator_jobs=1,
    params:
        seqs=config["bench"]["attention"]["seqs"],
        seq=config["bench"]["attention"]["seq"],
        python=python(),
    shell:
        "{params.python} -m benchmarks.attention_check --model {input.model} --seqs {params.seqs} "
        "--seq {params.seq} --out {output} > {log} 2>&1"


# a regression (throughput or peak memory beyond the tolerance) fails the job; its report stays in the log
rule compare_baseline:
    input:
        BENCH / "{stage}.jsonl",
    output:
        BENCH / "compare-{stage}.json",
    log:
        BENCH / "logs" / "compare-{stage}.log",
    container:
        gpu_image
    params:
        python=python(),
    shell:
        "{params.python} -m benchmarks.compare {input} --json {output} > {log} 2>&1"


# The GRPO step with each rollout on one batch (bench.rollout): a fresh run each, then their steady steps
# compared (benchmarks.rollout_ratio leaves out step 1 and any step that saved a checkpoint)
rule rollout_run:
    input:
        rollout_inputs,
    output:
        BENCH / "rollout" / "{side}" / "run.json",
    log:
        BENCH / "logs" / "rollout.{side}.log",
    wildcard_constraints:
        side="hf|vllm",
    container:
        gpu_image
    resources:
        accelerator_jobs=1,
    params:
        # this rule's own run directory: a run left by an earlier attempt would resume instead of train
        rundir=subpath(output[0], parent=True),
        launch=lambda wc: rollout_command(wc.side),
    shell:
        "rm -rf {params.rundir}; {params.launch} > {log} 2>&1"


rule rollout_ratio:
    input:
        hf=BENCH / "rollout" / "hf" / "run.json",
        vllm=BENCH / "rollout" / "vllm" / "run.json",
    output:
        BENCH / "rollout-ratio.json",
    log:
        BENCH / "logs" / "rollout-ratio.log",
    container:
        gpu_image
    params:
        python=python(),
        hf=subpath(input.hf, parent=True),
        vllm=subpath(input.vllm, parent=True),
    shell:
        "{params.python} -m benchmarks.rollout_ratio {params.hf} {params.vllm} --labels hf,vllm "
        "--json {output} > {log} 2>&1"
