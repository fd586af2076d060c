"""A provenance record as an RO-Crate 1.1 Workflow Run Crate, a Provenance Run Crate for the Snakemake chain.

Every record: Process Run Crate 0.5, Workflow Run Crate 0.5 and Workflow RO-Crate 1.0, with `launch.sh`
(the verl command `engine run` wrote) as the workflow and one CreateAction `#run`. A record of the
Snakemake chain (`provenance write --workflow Snakefile`) also claims Provenance Run Crate 0.5: the
Snakefile is the workflow, each step (prepare_data, smoke, train, export) is a HowToStep run by an
engine command (engine.records.rocrate_chain). The crates pass rocrate-validator 0.13.0 at REQUIRED for
every claimed profile and at RECOMMENDED for ro-crate-1.1 and workflow-run-crate-0.5
(tests/records/test_rocrate.py).
"""

from __future__ import annotations

import functools
import mimetypes
from pathlib import PurePosixPath
from typing import Any

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
FORMATS = {
    ".json": "application/json",
    ".jsonl": "application/jsonl",
    ".yaml": "application/yaml",
    ".txt": "text/plain",
    ".log": "text/plain",
    ".sh": "application/x-sh",
    ".md": "text/markdown",
    ".parquet": "application/vnd.apache.parquet",
    ".safetensors": "application/octet-stream",
    ".pt": "application/octet-stream",
    ".tsv": "text/tab-separated-values",
}
SNAKEFILE_NAMES = {"Snakefile", "snakefile"}
TRAIN_INPUTS = ("data", "model_config")
PYPI = "https://pypi.org/project/{}/"


def file_id(path: str) -> str:
    """Paths inside the run directory stay relative (the crate can move); others become file:// URIs."""
    return f"file://{path}" if path.startswith("/") else path


def encoding_format(path: str) -> str:
    name = PurePosixPath(path).name
    if name in SNAKEFILE_NAMES:
        return "text/x-snakemake"
    if name == "SHA256SUMS":
        return "text/plain"
    suffix = PurePosixPath(path).suffix
    return FORMATS.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"


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
    publisher = record.get("publisher") or {}
    org_id = publisher.get("url") or project()["source"]
    org = {
        "@id": org_id,
        "@type": "Organization",
        "name": publisher.get("name") or "qwen35-grpo-engine",
        "url": org_id,
    }
    agent = record.get("agent") or {}
    person = {
        "@id": "#agent",
        "@type": "Person",
        "name": agent.get("name") or "unknown",
        "affiliation": {"@id": org_id},
    }
    return {"@id": "#agent"}, [person, org]


def file_entities(record: dict[str, Any]) -> list[dict[str, Any]]:
    entities = []
    for e in record["inputs"] + record["outputs"] + record["run_files"]:
        entity = {
            "@id": file_id(e["path"]),
            "@type": "File",
            "name": PurePosixPath(e["path"]).name,
            "description": f"{e['role']} file",
            "contentSize": str(e["bytes"]),
            "encodingFormat": encoding_format(e["path"]),
            "sha256": e["sha256"],
        }
        if e["path"].startswith("/"):  # a web-based data entity: when its content was read
            entity["sdDatePublished"] = record["created"]
        entities.append(entity)
    return entities


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
        + [{"@id": "recipe.yaml"}],
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
    entity = {
        "@id": "#image",
        "@type": "ContainerImage",
        "additionalType": {"@id": "https://w3id.org/ro/terms/workflow-run#DockerImage"},
        "name": name or ref,
        "registry": registry,
    }
    if tag:
        entity["tag"] = tag
    if image.get("digest"):
        entity["sha256"] = str(image["digest"]).removeprefix("sha256:")
    return [entity]


def ro_crate(record: dict[str, Any]) -> dict[str, Any]:
    """The record as RO-Crate JSON-LD (a pure function of the record)."""
    from engine.records import rocrate_chain

    chain = record.get("workflow")
    agent, who = people(record)
    profiles = [PROCESS_RUN, WORKFLOW_RUN, WORKFLOW_RO_CRATE] + ([PROVENANCE_RUN] if chain else [])
    files = file_entities(record)
    env = [
        {"@id": f"#env-{k}", "@type": "PropertyValue", "name": k, "value": v}
        for k, v in record["environment"].items()
    ]
    if chain:
        main, extra = rocrate_chain.entities(record, agent)
    else:
        main = "launch.sh"
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
        "hasPart": [{"@id": f["@id"]} for f in files] + [{"@id": "provenance.json"}, {"@id": "README.md"}],
    }
    sw = software(record["versions"]["installed"])
    graph: list[dict[str, Any]] = [
        {
            "@id": "ro-crate-metadata.json",
            "@type": "CreativeWork",
            "about": {"@id": "./"},
            "conformsTo": [{"@id": RO_CRATE}, {"@id": WORKFLOW_RO_CRATE}],
        },
        root,
        *profile_entities(profiles),
        LICENSE,
        *who,
        {
            "@id": "provenance.json",
            "@type": "File",
            "name": "provenance.json",
            "encodingFormat": "application/json",
            "conformsTo": {"@id": "#schema"},
            "description": "the full record (docs/provenance.md)",
        },
        {"@id": "#schema", "@type": "CreativeWork", "name": record["schema"]},
        {
            "@id": "README.md",
            "@type": "File",
            "name": "README.md",
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


def crate_readme(record: dict[str, Any]) -> str:
    """README.md of the crate: what the record is and the commands that check it."""
    chain = record.get("workflow")
    steps = " -> ".join(s["name"] for s in chain["steps"]) if chain else "one `engine run`"
    return "\n".join(
        [
            f"# Run record of {record['recipe']['name']}",
            "",
            f"GRPO run of recipe `{record['recipe']['name']}` ({record.get('status')}, "
            f"{record.get('start')} -> {record.get('end')}), git {record['git'].get('commit')} "
            f"(dirty: {record['git'].get('dirty')}); steps: {steps}.",
            "",
            "- `provenance.json`: the full record (schema `" + record["schema"] + "`, docs/provenance.md)",
            "- `ro-crate-metadata.json`: the same as an RO-Crate 1.1 ("
            + ("Provenance" if chain else "Workflow")
            + " Run Crate 0.5)",
            "- check every hashed file: `python -m engine provenance verify .`",
            "- rerun and compare step metrics: `python -m engine rerun . --out NEW_DIR`",
            "",
        ]
    )


def _types(node: dict[str, Any]) -> list[str]:
    kind = node.get("@type", [])
    return [kind] if isinstance(kind, str) else list(kind)
