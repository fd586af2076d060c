"""A provenance record as a Workflow Run Crate (RO-Crate 1.1 with the Process/Workflow Run Crate profiles)."""

from __future__ import annotations

from typing import Any


def ro_crate(record: dict[str, Any]) -> dict[str, Any]:
    """The record as a Workflow Run Crate (RO-Crate 1.1, Process/Workflow Run Crate profiles)."""
    profiles = [
        "https://w3id.org/ro/wfrun/process/0.5",
        "https://w3id.org/ro/wfrun/workflow/0.5",
        "https://w3id.org/workflowhub/workflow-ro-crate/1.0",
    ]
    files = [
        {
            "@id": e["path"] if not e["path"].startswith("/") else f"file://{e['path']}",
            "@type": "File",
            "contentSize": e["bytes"],
            "sha256": e["sha256"],
            "additionalType": e["role"],
        }
        for e in record["inputs"] + record["outputs"] + record["run_files"]
    ]
    ids = {
        e["path"]: f["@id"]
        for e, f in zip(record["inputs"] + record["outputs"] + record["run_files"], files, strict=True)
    }
    software = [
        {"@id": f"#sw-{name}", "@type": "SoftwareApplication", "name": name, "softwareVersion": str(v)}
        for name, v in sorted(record["versions"]["installed"].items())
        if v
    ]
    env = [
        {"@id": f"#env-{k}", "@type": "PropertyValue", "name": k, "value": v}
        for k, v in record["environment"].items()
    ]
    image = record["container"]
    action: dict[str, Any] = {
        "@id": "#run",
        "@type": "CreateAction",
        "name": f"GRPO run of {record['recipe']['name']}",
        "instrument": {"@id": "launch.sh"},
        "startTime": record["start"],
        "endTime": record["end"],
        "actionStatus": {
            "@id": "http://schema.org/CompletedActionStatus"
            if record["exit_code"] == 0
            else "http://schema.org/FailedActionStatus"
        },
        "object": [{"@id": ids[e["path"]]} for e in record["inputs"]] + [{"@id": "recipe.yaml"}],
        "result": [{"@id": ids[e["path"]]} for e in record["outputs"]],
        "environment": [{"@id": e["@id"]} for e in env],
        "description": f"git {record['git'].get('commit')} dirty={record['git'].get('dirty')}; "
        f"overrides sha256 {record['overrides_sha256']}",
    }
    graph: list[dict[str, Any]] = [
        {
            "@id": "ro-crate-metadata.json",
            "@type": "CreativeWork",
            "about": {"@id": "./"},
            "conformsTo": [
                {"@id": "https://w3id.org/ro/crate/1.1"},
                {"@id": "https://w3id.org/workflowhub/workflow-ro-crate/1.0"},
            ],
        },
        {
            "@id": "./",
            "@type": "Dataset",
            "name": f"Run record of {record['recipe']['name']}",
            "datePublished": record["created"],
            "license": "Apache-2.0",
            "conformsTo": [{"@id": p} for p in profiles],
            "mainEntity": {"@id": "launch.sh"},
            "mentions": [{"@id": "#run"}],
            "hasPart": [{"@id": f["@id"]} for f in files] + [{"@id": "provenance.json"}],
        },
        {
            "@id": "launch.sh",
            "@type": ["File", "SoftwareSourceCode", "ComputationalWorkflow"],
            "name": "verl main_ppo launch",
            "programmingLanguage": {"@id": "#bash"},
            "softwareRequirements": [{"@id": s["@id"]} for s in software],
        },
        {"@id": "#bash", "@type": "ComputerLanguage", "name": "Bash"},
        {
            "@id": "provenance.json",
            "@type": "File",
            "encodingFormat": "application/json",
            "conformsTo": {"@id": "#schema"},
            "description": "full record (docs/provenance.md)",
        },
        {"@id": "#schema", "@type": "CreativeWork", "name": record["schema"]},
        action,
        *files,
        *software,
        *env,
    ]
    if image.get("image") or image.get("digest"):
        action["containerImage"] = {"@id": "#image"}
        graph.append(
            {
                "@id": "#image",
                "@type": "ContainerImage",
                "name": image.get("image"),
                "sha256": (image.get("digest") or "").removeprefix("sha256:") or None,
            }
        )
    seen, unique = set(), []
    for node in graph:
        if node["@id"] not in seen:
            seen.add(node["@id"])
            unique.append(node)
    return {
        "@context": [
            "https://w3id.org/ro/crate/1.1/context",
            "https://w3id.org/ro/terms/workflow-run/context",
        ],
        "@graph": unique,
    }
