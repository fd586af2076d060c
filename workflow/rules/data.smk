# prepare_data: raw dataset -> verl RL parquet + manifest (row counts, sha256 of every output).


rule prepare_data:
    output:
        train="results/{recipe}/data/train.parquet",
        test="results/{recipe}/data/test.parquet",
        manifest="results/{recipe}/data/manifest.json",
    log:
        "results/{recipe}/logs/prepare_data.log",
    benchmark:
        "results/{recipe}/benchmarks/prepare_data.tsv"
    container:
        image
    params:
        dataset=dataset_args,
        out=subpath(output.manifest, parent=True),
        python=python(),
    shell:
        "{params.python} -m engine prepare-data {params.dataset} --out {params.out} > {log} 2>&1"


rule tiny_assets:
    output:
        "results/assets/assets.json",
    log:
        "results/logs/tiny_assets.log",
    container:
        image
    params:
        out=subpath(output[0], parent=True),
        seed=config["synthetic_seed"],
        python=python(),
    shell:
        "{params.python} -m engine assets --out {params.out} --seed {params.seed} > {log} 2>&1"
