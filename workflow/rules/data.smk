# prepare_data: raw dataset -> verl RL parquet + manifest (row counts, sha256 of every output).


rule prepare_data:
    output:
        train=CHAIN.split("train"),
        test=CHAIN.split("test"),
        manifest=CHAIN.manifest,
    log:
        CHAIN.log("prepare_data"),
    benchmark:
        CHAIN.benchmark("prepare_data")
    container:
        image
    params:
        dataset=dataset_args,
        out=subpath(output.manifest, parent=True),
        python=python(),
    shell:
        "{params.python} -m engine prepare-data {params.dataset} --out {params.out} > {log} 2>&1"


# the whole directory is the output: Snakemake removes it before a forced or incomplete rerun, so the
# command never meets a partial copy it would have to refuse
rule tiny_assets:
    output:
        directory(ASSETS),
    log:
        RESULTS / "logs" / "tiny_assets.log",
    container:
        image
    params:
        seed=config["synthetic_seed"],
        python=python(),
    shell:
        "{params.python} -m engine assets --out {output} --seed {params.seed} > {log} 2>&1"


# random-init models in a registry shape (recipes with model.init: random), seeded like the data
rule random_model:
    output:
        directory(models_dir() / "{model}"),
    log:
        RESULTS / "logs" / "random_model.{model}.log",
    container:
        image
    params:
        seed=config["synthetic_seed"],
        small=" --small" if config["small_models"] else "",
        python=python(),
    shell:
        "{params.python} -m engine make-model --model {wildcards.model} --seed {params.seed}{params.small} "
        "--out {output} > {log} 2>&1"
