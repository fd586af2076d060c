"""The Snakemake chain of a record as Provenance Run Crate 0.5 entities.

The Snakefile is the workflow (`ComputationalWorkflow` + `HowTo`); each rule that ran is a `HowToStep`
whose tool is the engine command of the rule; each step run is a `CreateAction` (the train step is
`#run`), wrapped by a `ControlAction`; an `OrganizeAction` of Snakemake ties them to the workflow run.
"""

from __future__ import annotations

from typing import Any

from engine.records import rocrate

SNAKEMAKE_DOCS = "https://snakemake.readthedocs.io/"


def tool_id(command: str) -> str:
    """Absolute id of an engine command (`python -m engine run` -> <source>#engine-run)."""
    return f"{rocrate.project()['source']}#engine-{command.split()[-1]}"


def _tools(steps: list[dict[str, Any]], version: str) -> list[dict[str, Any]]:
    source = rocrate.project()["source"]
    tools: dict[str, dict[str, Any]] = {}
    for step in steps:
        tools.setdefault(
            step["command"],
            {
                "@id": tool_id(step["command"]),
                "@type": "SoftwareApplication",
                "name": step["command"],
                "description": f"the engine command of rule(s) {step['name']}",
                "url": source,
                "softwareVersion": version,
            },
        )
        if step["name"] not in tools[step["command"]]["description"]:
            tools[step["command"]]["description"] += f", {step['name']}"
    return list(tools.values())


def _step_action(step: dict[str, Any], record: dict[str, Any], agent: dict[str, Any]) -> dict[str, Any]:
    if step["name"] == "train":
        action = rocrate.run_action(record, tool_id(step["command"]), agent)
    else:
        action = {
            "@id": f"#run-{step['name']}",
            "@type": "CreateAction",
            "name": f"{step['name']} of {record['recipe']['name']}",
            "description": step["description"],
            "instrument": {"@id": tool_id(step["command"])},
            "agent": agent,
            "actionStatus": rocrate.STATUS[step.get("exit_code") in (0, None)],
            "object": [{"@id": rocrate.file_id(p)} for p in step["object"]],
            "result": [{"@id": rocrate.file_id(p)} for p in step["result"]],
        }
        for key, prop in (("start", "startTime"), ("end", "endTime")):
            if step.get(key):
                action[prop] = step[key]
    return action


def entities(record: dict[str, Any], agent: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """(id of the workflow, the entities of tools, steps and actions)."""
    chain = record["workflow"]
    steps = chain["steps"]
    engine_version = str(record["versions"]["installed"].get("engine"))
    snakemake = {
        "@id": rocrate.PYPI.format("snakemake"),
        "@type": "SoftwareApplication",
        "name": "Snakemake",
        "url": SNAKEMAKE_DOCS,
        "softwareVersion": str(chain["engine"]["version"]),
    }
    language = {
        "@id": "#snakemake",
        "@type": "ComputerLanguage",
        "name": "Snakemake",
        "url": {"@id": SNAKEMAKE_DOCS},
        "version": str(chain["engine"]["version"]),
    }
    tools = _tools(steps, engine_version)
    main = rocrate.file_id(chain["snakefile"])
    howto = [
        {
            "@id": f"#step-{s['name']}",
            "@type": "HowToStep",
            "name": s["name"],
            "position": s["position"],
            "workExample": {"@id": tool_id(s["command"])},
        }
        for s in steps
    ]
    workflow = {
        "@id": main,
        "name": "Snakefile (prepare_data -> smoke -> train -> export -> provenance)",
        "programmingLanguage": {"@id": language["@id"]},
        "hasPart": [{"@id": t["@id"]} for t in tools],
        "step": [{"@id": h["@id"]} for h in howto],
    }
    runs = [_step_action(s, record, agent) for s in steps]
    controls = [
        {
            "@id": f"#control-{s['name']}",
            "@type": "ControlAction",
            "name": f"orchestrate {s['name']}",
            "instrument": {"@id": f"#step-{s['name']}"},
            "object": {"@id": run["@id"]},
        }
        for s, run in zip(steps, runs, strict=True)
    ]
    starts = [r["startTime"] for r in runs if r.get("startTime")]
    ends = [r["endTime"] for r in runs if r.get("endTime")]
    ok = all(r["actionStatus"] == rocrate.STATUS[True] for r in runs)
    times = ({"startTime": min(starts)} if starts else {}) | ({"endTime": max(ends)} if ends else {})
    exports = [{"@id": rocrate.file_id(e["path"])} for e in record["outputs"] if e["role"] == "export"]
    workflow_run = {
        "@id": "#workflow-run",
        "@type": "CreateAction",
        "name": f"Snakemake run of recipe {record['recipe']['name']}",
        "description": f"{len(steps)} steps: " + " -> ".join(s["name"] for s in steps),
        "instrument": {"@id": main},
        "agent": agent,
        "actionStatus": rocrate.STATUS[ok],
        "object": [{"@id": "recipe.yaml"}],
        "result": exports or [{"@id": rocrate.file_id(p)} for p in steps[-1]["result"]],
        **times,
    }
    organize = {
        "@id": "#organize",
        "@type": "OrganizeAction",
        "name": f"Snakemake {chain['engine']['version']} orchestration",
        "instrument": {"@id": snakemake["@id"]},
        "agent": agent,
        "object": [{"@id": c["@id"]} for c in controls],
        "result": {"@id": workflow_run["@id"]},
        **times,
    }
    return main, [workflow, workflow_run, organize, *runs, *controls, *howto, *tools, snakemake, language]
