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
