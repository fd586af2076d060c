"""A provenance record as an RO-Crate 1.1 Workflow Run Crate, a Provenance Run Crate for the Snakemake chain.

Every record: Process Run Crate 0.5, Workflow Run Crate 0.5 and Workflow RO-Crate 1.0, with `launch.sh`
(the verl command `engine run` wrote) as the workflow and one CreateAction `#run`. A record of the
Snakemake chain (`provenance write --workflow Snakefile`) also claims Provenance Run Crate 0.5: the
Snakefile is the workflow, each step (prepare_data, smoke, train, export) is a HowToStep run by an
engine command. The crates pass rocrate-validator 0.13.0 at REQUIRED for
every claimed profile and at RECOMMENDED for ro-crate-1.1 and workflow-run-crate-0.5
(tests/records/test_rocrate.py).
"""

from __future__ import annotations

import functools
import mimetypes
from pathlib import PurePosixPath
from typing import Any

from engine.checkpoint import layout
from engine.run import rundir

CONTEXT = ["https://w3id.org/ro/crate/1.1/context", "https://w3id.org/ro/terms/workflow-run/context"]
RO_CRATE = "https://w3id.org/ro/crate/1.1"
WORKFLOW_RO_CRATE = "https://w3id.org/workflowhub/workflow-ro-crate/1.0"
PROCESS_RUN = "https://w3id.org/ro/wfrun/process/0.5"
WORKFLOW_RUN = "https://w3id.org/ro/wfrun/workflow/0.5"
PROVENANCE_RUN = "https://w3id.org/ro/wfrun/provenance/0.5"
PROFILE_NAMES = {
    RO_CRATE: ("RO-Crate Metadata Specification", "1.1"),
    WORKFLOW_RO_CRATE: ("Workflow RO-Crate", "1.0"),
    PROCESS_RUN: ("Process Run Crate", "0.5"),
    WORKFLOW_RUN: ("Workflow Run Crate", "0.5"),
    PROVENANCE_RUN: ("Provenance Run Crate", "0.5"),
}
BIOSCHEMAS_WORKFLOW = "https://bioschemas.org/profiles/ComputationalWorkflow/1.0-RELEASE"
LICENSE = {
    "@id": "https://spdx.org/licenses/Apache-2.0",
    "@type": "CreativeWork",
    "name": "Apache License 2.0",
    "identifier": "Apache-2.0",
}
# the Process Run Crate rule compares the literal value
STATUS = {True: "http://schema.org/CompletedActionStatus", False: "http://schema.org/FailedActionStatus"}
FORMATS = {  # what mimetypes does not know (or not on every Python the engine supports)
    ".jsonl": "application/jsonl",
    ".yaml": "application/yaml",
    ".log": "text/plain",
    ".md": "text/markdown",
    ".parquet": "application/vnd.apache.parquet",
}
SNAKEFILE_NAMES = {"Snakefile", "snakefile"}
TRAIN_INPUTS = ("data", "model_config")
PYPI = "https://pypi.org/project/{}/"
SNAKEMAKE_DOCS = "https://snakemake.readthedocs.io/"


def file_id(path: str) -> str:
    """Paths inside the run directory stay relative (the crate can move); others become file:// URIs."""
    return f"file://{path}" if path.startswith("/") else path


def encoding_format(path: str) -> str:
    name = PurePosixPath(path).name
    if name in SNAKEFILE_NAMES:
        return "text/x-snakemake"
    if name == layout.EXPORT_SUMS:
        return "text/plain"
    return (
        FORMATS.get(PurePosixPath(path).suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"
    )


@functools.cache
def project() -> dict[str, str]:
    """The engine's own identity from the pins: its source URL (the image label's), FSDPTurbo's repository."""
    from engine.env import pins

    loaded = pins.load_pins()
    return {"source": loaded["image"]["source"], "fsdp_turbo": loaded["fsdp_turbo"]["repository"]}


def software(installed: dict[str, Any]) -> list[dict[str, Any]]:
    """Installed packages as SoftwareApplications with absolute ids (PyPI pages, or their repositories)."""
    from engine.env.pins import TRACKED

    ours = project()
    entities = []
    for key, version in sorted(installed.items()):
        if not version or key.endswith("_commit"):
            continue
        if key == "engine":
            url = ours["source"]
        elif key == "fsdp_turbo" and ours["fsdp_turbo"]:
            url = ours["fsdp_turbo"]
        else:
            url = PYPI.format(TRACKED.get(key, key))
        entity = {"@id": url, "@type": "SoftwareApplication", "name": key, "url": url}
        entity["softwareVersion"] = str(version)
        commit = installed.get(f"{key}_commit")
        if commit:
            entity["description"] = f"commit {commit}"
        entities.append(entity)
    return entities


def people(record: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(reference to the agent, [Person, Organization]) from the record's `agent` and `publisher`."""
    publisher, agent = record.get("publisher") or {}, record.get("agent") or {}
    org_id = publisher.get("url") or project()["source"]
    org = {"@id": org_id, "@type": "Organization", "name": publisher.get("name") or "qwen35-grpo-engine"}
    person = {"@id": "#agent", "@type": "Person", "name": agent.get("name") or "unknown"}
    return {"@id": "#agent"}, [person | {"affiliation": {"@id": org_id}}, org | {"url": org_id}]


def file_entities(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every hashed file; one outside the crate is a web-based data entity, dated when it was read."""
    return [
        {"@id": file_id(e["path"]), "@type": "File", "name": PurePosixPath(e["path"]).name}
        | {"description": f"{e['role']} file", "contentSize": str(e["bytes"]), "sha256": e["sha256"]}
        | {"encodingFormat": encoding_format(e["path"])}
        | ({"sdDatePublished": record["created"]} if e["path"].startswith("/") else {})
        for e in record["inputs"] + record["outputs"] + record["run_files"]
    ]


def profile_entities(profiles: list[str]) -> list[dict[str, Any]]:
    return [
        {"@id": p, "@type": "CreativeWork", "name": PROFILE_NAMES[p][0], "version": PROFILE_NAMES[p][1]}
        for p in profiles
    ]


def run_action(record: dict[str, Any], instrument: str, agent: dict[str, Any]) -> dict[str, Any]:
    """`#run`: the training run (verl's main_ppo through `engine run`)."""
    action: dict[str, Any] = {
        "@id": "#run",
        "@type": "CreateAction",
        "name": f"GRPO run of {record['recipe']['name']}",
        "description": f"`python -m engine run` of recipe {record['recipe']['name']} at git "
        f"{record['git'].get('commit')} (dirty: {record['git'].get('dirty')}); "
        f"Hydra overrides sha256 {record['overrides_sha256']}",
        "instrument": {"@id": instrument},
        "agent": agent,
        "actionStatus": STATUS[record["exit_code"] == 0],
        "object": [{"@id": file_id(e["path"])} for e in record["inputs"] if e["role"] in TRAIN_INPUTS]
        + [{"@id": rundir.RECIPE}],
        "result": [{"@id": file_id(e["path"])} for e in record["outputs"] if e["role"] == "checkpoint"],
        "environment": [{"@id": f"#env-{k}"} for k in record["environment"]],
    }
    for key, prop in (("start", "startTime"), ("end", "endTime")):
        if record.get(key):
            action[prop] = record[key]
    if record["exit_code"] not in (0, None):
        action["error"] = f"exit code {record['exit_code']}"
    image = record["container"]
    if image.get("image") or image.get("digest"):
        action["containerImage"] = {"@id": "#image"}
    return action


def image_entity(image: dict[str, Any]) -> list[dict[str, Any]]:
    if not (image.get("image") or image.get("digest")):
        return []
    ref = str(image.get("image") or "").split("@", 1)[0]  # a digest is recorded as sha256
    registry, _, rest = ref.partition("/") if "/" in ref else ("docker.io", "", ref)
    name, _, tag = rest.partition(":")
    entity = {"@id": "#image", "@type": "ContainerImage", "name": name or ref, "registry": registry}
    entity["additionalType"] = {"@id": "https://w3id.org/ro/terms/workflow-run#DockerImage"}
    entity |= {"tag": tag} if tag else {}
    entity |= {"sha256": str(image["digest"]).removeprefix("sha256:")} if image.get("digest") else {}
    return [entity]


def ro_crate(record: dict[str, Any]) -> dict[str, Any]:
    """The record as RO-Crate JSON-LD (a pure function of the record)."""
    chain = record.get("workflow")
    agent, who = people(record)
    profiles = [PROCESS_RUN, WORKFLOW_RUN, WORKFLOW_RO_CRATE] + ([PROVENANCE_RUN] if chain else [])
    files = file_entities(record)
    env = [
        {"@id": f"#env-{k}", "@type": "PropertyValue", "name": k, "value": v}
        for k, v in record["environment"].items()
    ]
    if chain:
        main, extra = chain_entities(record, agent)
    else:
        main = rundir.LAUNCH_SCRIPT
        extra = [run_action(record, main, agent)]
        extra += [
            {
                "@id": "#bash",
                "@type": "ComputerLanguage",
                "name": "Bash",
                "url": {"@id": "https://www.gnu.org/software/bash/"},
            }
        ]
    actions = [
        n["@id"] for n in extra if n.get("@type") in ("CreateAction", "OrganizeAction", "ControlAction")
    ]
    root = {
        "@id": "./",
        "@type": "Dataset",
        "name": f"Run record of {record['recipe']['name']}",
        "description": f"Provenance of a GRPO run of recipe {record['recipe']['name']} "
        f"({record.get('status')}): inputs, checkpoints, exports and run files with their sha256, "
        "the software versions and the environment. provenance.json holds the full record.",
        "datePublished": record["created"],
        "license": {"@id": LICENSE["@id"]},
        "author": agent,
        "publisher": {"@id": who[1]["@id"]},
        "conformsTo": [{"@id": p} for p in profiles],
        "mainEntity": {"@id": main},
        "mentions": [{"@id": a} for a in actions],
        "hasPart": [{"@id": f["@id"]} for f in files]
        + [{"@id": rundir.PROVENANCE}, {"@id": rundir.CRATE_README}],
    }
    sw = software(record["versions"]["installed"])
    graph: list[dict[str, Any]] = [
        {
            "@id": rundir.CRATE,
            "@type": "CreativeWork",
            "about": {"@id": "./"},
            "conformsTo": [{"@id": RO_CRATE}, {"@id": WORKFLOW_RO_CRATE}],
        },
        root,
        *profile_entities(profiles),
        LICENSE,
        *who,
        {
            "@id": rundir.PROVENANCE,
            "@type": "File",
            "name": rundir.PROVENANCE,
            "encodingFormat": "application/json",
            "conformsTo": {"@id": "#schema"},
            "description": "the full record (docs/reference/records.md)",
        },
        {"@id": "#schema", "@type": "CreativeWork", "name": record["schema"]},
        {
            "@id": rundir.CRATE_README,
            "@type": "File",
            "name": rundir.CRATE_README,
            "about": {"@id": "./"},
            "encodingFormat": "text/markdown",
            "description": "what this record is and how to check it",
        },
        *extra,
        *files,
        *sw,
        *env,
        *image_entity(record["container"]),
    ]
    merged: dict[str, dict[str, Any]] = {}
    for node in graph:  # one entity per id: later descriptions of it add properties
        entity = merged.setdefault(node["@id"], {})
        for key, value in node.items():
            entity.setdefault(key, value)
    workflow = merged[main]
    workflow["@type"] = sorted(
        {*_types(workflow), "File", "SoftwareSourceCode", "ComputationalWorkflow"}
        | ({"HowTo"} if chain else set())
    )
    workflow.setdefault("name", "verl main_ppo launch")
    workflow.setdefault("programmingLanguage", {"@id": "#bash"})
    workflow["url"] = {"@id": main}  # where it is: in the crate, or the Snakefile that ran the chain
    workflow["conformsTo"] = {"@id": BIOSCHEMAS_WORKFLOW}
    workflow["version"] = str(record["git"].get("commit") or record["versions"]["installed"].get("engine"))
    workflow["softwareRequirements"] = [{"@id": s["@id"]} for s in sw]
    return {"@context": CONTEXT, "@graph": [_singles(n) for n in merged.values()]}


def _singles(node: dict[str, Any]) -> dict[str, Any]:
    """RO-Crate 1.1 JSON-LD: a property with one value is written as that value, not a one-item list."""
    return {k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in node.items()}


def _types(node: dict[str, Any]) -> list[str]:
    kind = node.get("@type", [])
    return [kind] if isinstance(kind, str) else list(kind)


def tool_id(command: str) -> str:
    """Absolute id of an engine command (`python -m engine run` -> <source>#engine-run)."""
    return f"{project()['source']}#engine-{command.split()[-1]}"


def _tools(steps: list[dict[str, Any]], version: str) -> list[dict[str, Any]]:
    """One SoftwareApplication per engine command, naming the rules that ran it."""
    rules: dict[str, list[str]] = {}
    for step in steps:
        rules.setdefault(step["command"], []).append(step["name"])
    return [
        {"@id": tool_id(command), "@type": "SoftwareApplication", "name": command, "url": project()["source"]}
        | {"description": f"the engine command of rule(s) {', '.join(names)}", "softwareVersion": version}
        for command, names in rules.items()
    ]


def _step_action(step: dict[str, Any], record: dict[str, Any], agent: dict[str, Any]) -> dict[str, Any]:
    if step["name"] == "train":
        action = run_action(record, tool_id(step["command"]), agent)
    else:
        action = {
            "@id": f"#run-{step['name']}",
            "@type": "CreateAction",
            "name": f"{step['name']} of {record['recipe']['name']}",
            "description": step["description"],
            "instrument": {"@id": tool_id(step["command"])},
            "agent": agent,
            "actionStatus": STATUS[step.get("exit_code") in (0, None)],
            "object": [{"@id": file_id(p)} for p in step["object"]],
            "result": [{"@id": file_id(p)} for p in step["result"]],
        }
        for key, prop in (("start", "startTime"), ("end", "endTime")):
            if step.get(key):
                action[prop] = step[key]
    return action


def chain_entities(record: dict[str, Any], agent: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The Snakemake chain: the Snakefile is the workflow (`ComputationalWorkflow` + `HowTo`), each rule that
    ran a `HowToStep` whose tool is its engine command, each step run a `CreateAction` (train: `#run`)
    in a `ControlAction`, and Snakemake's `OrganizeAction` ties them to the workflow run.
    Returns (id of the workflow, the entities of tools, steps and actions)."""
    chain = record["workflow"]
    steps = chain["steps"]
    engine_version = str(record["versions"]["installed"].get("engine"))
    version = str(chain["engine"]["version"])
    snakemake = {"@id": PYPI.format("snakemake"), "@type": "SoftwareApplication", "name": "Snakemake"}
    snakemake |= {"url": SNAKEMAKE_DOCS, "softwareVersion": version}
    language = {"@id": "#snakemake", "@type": "ComputerLanguage", "name": "Snakemake"}
    language |= {"url": {"@id": SNAKEMAKE_DOCS}, "version": version}
    tools = _tools(steps, engine_version)
    main = file_id(chain["snakefile"])
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
    ok = all(r["actionStatus"] == STATUS[True] for r in runs)
    times = ({"startTime": min(starts)} if starts else {}) | ({"endTime": max(ends)} if ends else {})
    exports = [{"@id": file_id(e["path"])} for e in record["outputs"] if e["role"] == "export"]
    workflow_run = {
        "@id": "#workflow-run",
        "@type": "CreateAction",
        "name": f"Snakemake run of recipe {record['recipe']['name']}",
        "description": f"{len(steps)} steps: " + " -> ".join(s["name"] for s in steps),
        "instrument": {"@id": main},
        "agent": agent,
        "actionStatus": STATUS[ok],
        "object": [{"@id": rundir.RECIPE}],
        "result": exports or [{"@id": file_id(p)} for p in steps[-1]["result"]],
        **times,
    }
    organize = {
        "@id": "#organize",
        "@type": "OrganizeAction",
        "name": f"Snakemake {version} orchestration",
        "instrument": {"@id": snakemake["@id"]},
        "agent": agent,
        "object": [{"@id": c["@id"]} for c in controls],
        "result": {"@id": workflow_run["@id"]},
        **times,
    }
    return main, [workflow, workflow_run, organize, *runs, *controls, *howto, *tools, snakemake, language]
