# GRPO of Qwen3.5 on verl's fsdp_turbo backend, one recipe per run:
#   prepare_data -> smoke -> train -> export -> provenance   (outputs under results/<recipe>/)
# `snakemake smoke_cpu` runs the tiny recipe end to end on a laptop (`learn_cpu`: the 30-step run whose
# reward must rise, with its learning curve in the report); `snakemake run_qwen35_35b
# --profile profiles/slurm_gpu --config nodes=2` the full run on a cluster. See docs/guide/workflow.md.

from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "workflow/config.yaml"


include: "workflow/rules/common.smk"


# The config is checked before anything else: one clear line on bad input, no job started.
validate_config("workflow/schemas/config.schema.yaml")
validate(config, schema="workflow/schemas/config.schema.yaml")


report: "workflow/report/workflow.rst"


wildcard_constraints:
    recipe="|".join(RECIPES),
    model="|".join(re.escape(name) for name in RANDOM_MODELS),
    stage="|".join(re.escape(name) for name in config["bench"]["stages"]),


include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/bench.smk"


rule smoke_cpu:
    input:
        lambda wc: targets(recipe_of("smoke_cpu")),


rule learn_cpu:
    input:
        lambda wc: targets(recipe_of("learn_cpu")),


rule run_qwen35_35b:
    input:
        lambda wc: targets(recipe_of("run_qwen35_35b")),


rule run_qwen35_27b:
    input:
        lambda wc: targets(recipe_of("run_qwen35_27b")),


rule ci_smoke_gpu:
    input:
        lambda wc: targets(recipe_of("ci_smoke_gpu")),


rule ci_smoke_npu:
    input:
        lambda wc: targets(recipe_of("ci_smoke_npu")),


rule bench_levers:
    input:
        lambda wc: bench_targets(),


rule run:
    input:
        lambda wc: targets(
            config["recipe"] or fail("the run target needs --config recipe=NAME")
        ),
