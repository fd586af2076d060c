# Trainer benchmarks on one GPU (docs/reference/trainer-levers.md): each trainer lever's own effect on the
# 35B-A3B architecture at 6 layers and on the dense 0.8B beside plain FSDP2, packing on the MoE, the
# levers' numerics through verl's engine, and each stage compared with its regression baseline.
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
        python=python(),
    shell:
        "{params.python} -m benchmarks.gpu_bench run --model {input.model} {params.args} --out {output} "
        "> {log} 2>&1"


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
        kept=BENCH / "logs" / "numerics.failed.jsonl",
        python=python(),
    shell:
        # a lever out of its tolerance fails the job, and Snakemake removes a failed job's output: the
        # rows that show why are kept beside the log
        "{params.python} -m benchmarks.trainer_numerics --model {input.model} --seq {params.seq} "
        "--lr {params.lr} --out {output} > {log} 2>&1 || {{ cp {output} {params.kept} 2>/dev/null; exit 1; }}"


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
