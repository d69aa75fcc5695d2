#!/usr/bin/env python
"""Write a Slurm batch script or a Kubernetes JobSet that runs a training command on a scheduler.

    python tools/launch_job.py slurm --time 04:00:00 [--partition P] [--gpus-per-node 8] ... \\
        -m megatron_rl.train <the flags you would give megatron_rl.train>
    python tools/launch_job.py k8s --image REGISTRY/megatron-rl:TAG [--volume PVC:/mnt] ... \\
        -m megatron_rl.train <flags>

Everything after ``-m megatron_rl.train`` (or ``--``) is the training command, as
``python -m megatron_rl.infra.launch --run-dir D [torchrun flags] -m megatron_rl.train <flags>`` takes it: the
torchrun part is derived here (nodes from ``--actor-num-nodes``, ranks per node from
``--actor-num-gpus-per-node``, the run dir from ``--output-dir``) and filled in per node by the scheduler. A
launch script passes its own flags the same way: ``JOB=slurm JOB_ARGS="--time 4:00:00" bash scripts/run_....sh``.

The flags are validated as the real run validates them (files, placement, model shape; exit 2 with the same
error lines a run would print) unless ``--no-validate`` (a submit host that cannot see the cluster's paths).
A run without ``--save`` is refused: a requeued or restarted job resumes from ``--save``, and without it every
restart would start over.

The output comes from a template in ``tools/launch_templates/`` (``--template FILE`` for a site's own copy):
the scheduler's semantics (exit 3 requeues or restarts, 2 does not, the time-limit signal) live there, in the
scheduler's own language, where a site reviews and extends them; this file fills in only what a run's flags
decide. docs/launch.md says what each route does and how it was measured. Exit status: 0 written, 2 refused.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.errors import ConfigError  # noqa: E402

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_templates")
TRAIN_MODULE = "megatron_rl.train"
EXIT_REFUSED = 2
# Slurm sends the --signal warning "up to 60 seconds earlier than specified" (sbatch(1)); its own limit on the
# lead is 65535 s
SLURM_SIGNAL_SLACK_S = 60
SLURM_MAX_SIGNAL_LEAD_S = 65535
# the podFailurePolicy rule indexes the JobSet's failurePolicy rules name (tools/launch_templates/jobset.yaml)
K8S_REFUSED_RULE, K8S_STOPPED_RULE, K8S_DISRUPTED_RULE = 0, 1, 2


class JobError(ConfigError):
    """A job that cannot be written as asked: the message names the flag and the fix (exit 2)."""


@dataclass(frozen=True)
class RunShape:
    """What the scheduler must know of a run, read from its training flags."""

    train_args: tuple[str, ...]
    nnodes: int
    nproc_per_node: int
    run_dir: str  # --output-dir: run_status.json, metrics.jsonl (the launcher's --run-dir)
    save: str  # --save: what a restarted attempt resumes from


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(generator options, training flags): the training flags follow ``-m megatron_rl.train`` or ``--``."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == TRAIN_MODULE:
            return argv[:i], argv[i + 2:]
        if arg == "--":
            rest = argv[i + 1:]
            if rest[:2] == ["-m", TRAIN_MODULE]:
                rest = rest[2:]
            return argv[:i], rest
    raise JobError(f"no training command: end the options with -m {TRAIN_MODULE} <flags> (or -- <flags>)")


def run_shape(train_args: list[str], *, validate: bool = True) -> RunShape:
    """Parse (and unless ``validate`` is False, validate as a real run would) the training flags."""
    from megatron_rl.config import parse_config
    from megatron_rl.config.validate import real_run_refusals

    cfg = parse_config(train_args, validate=validate)  # ConfigError: the same lines a run would print
    if cfg.mode.dry_run:
        raise JobError("--dry-run is in the training flags: a job of a dry run would start nothing; drop it (run "
                       "python -m megatron_rl.train --dry-run ... here to see the plan)")
    if validate:
        refused = real_run_refusals(cfg)
        if refused:
            raise JobError("a real run refuses this configuration:\n  - " + "\n  - ".join(refused))
    if not cfg.checkpoint.save:
        raise JobError("no --save: a requeued or restarted job resumes from --save, so without it every restart "
                       "would start from scratch; pass --save DIR (on storage every node shares)")
    return RunShape(tuple(train_args), cfg.placement.actor_num_nodes, cfg.placement.actor_num_gpus_per_node,
                    cfg.runtime.output_dir, cfg.checkpoint.save)


# ---------------------------------------------------------------------------------------------------- Slurm

_SLURM_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")


def slurm_time_seconds(text: str) -> int:
    """Seconds in a Slurm ``--time``: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (sbatch(1))."""
    m = _SLURM_TIME.match(text)
    if not m:
        raise JobError(f"--time {text!r} is not a Slurm time: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                       "D-HH:MM:SS")
    d, h, dm, ds, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if d is not None:
        return ((d * 24 + (h or 0)) * 60 + (dm or 0)) * 60 + (ds or 0)
    if c is not None:
        return ((a or 0) * 60 + (b or 0)) * 60 + c
    if b is not None:
        return (a or 0) * 60 + b
    return (a or 0) * 60


@dataclass(frozen=True)
class SlurmOptions:
    time: str
    signal_lead_s: int = 300
    job_name: str = "megatron-rl"
    partition: Optional[str] = None
    account: Optional[str] = None
    gpus_per_node: Optional[int] = None  # None: the run's ranks per node; 0: none asked (a CPU cluster)
    cpus_per_task: Optional[int] = None
    output: str = "%x-%j.out"
    max_requeues: int = 50
    master_port: Optional[int] = None
    python: str = field(default_factory=lambda: sys.executable)
    workdir: str = field(default_factory=os.getcwd)
    env: tuple[tuple[str, str], ...] = ()
    sbatch: tuple[str, ...] = ()


def _bash_array(name: str, items: tuple[str, ...]) -> str:
    """A bash array, one flag and its values to a line, each word quoted for bash."""
    lines: list[list[str]] = []
    for item in items:
        if item.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(shlex.quote(item))
    body = "".join(f"\n  {' '.join(words)}" for words in lines)
    return f"{name}=({body}\n)" if lines else f"{name}=()"


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def slurm_script(shape: RunShape, opts: SlurmOptions, *, template: Optional[str] = None, command: str = "") -> str:
    """The sbatch script's text (tools/launch_templates/slurm.sbatch with its three blocks filled)."""
    limit_s = slurm_time_seconds(opts.time)
    if not 1 <= opts.signal_lead_s <= SLURM_MAX_SIGNAL_LEAD_S:
        raise JobError(f"--signal-lead {opts.signal_lead_s}: use 1 to {SLURM_MAX_SIGNAL_LEAD_S} seconds")
    if opts.signal_lead_s + SLURM_SIGNAL_SLACK_S >= limit_s:
        raise JobError(f"--signal-lead {opts.signal_lead_s}s does not fit in --time {opts.time} ({limit_s}s): Slurm "
                       f"may signal up to {SLURM_SIGNAL_SLACK_S}s early, so the run would be asked to stop before it "
                       "started; raise --time or lower --signal-lead")
    if opts.max_requeues < 0:
        raise JobError(f"--max-requeues {opts.max_requeues}: use 0 or more")
    for key, _ in opts.env:
        if not _ENV_NAME.match(key):
            raise JobError(f"--env {key!r}: not a shell variable name")
    for line in opts.sbatch:
        if "\n" in line or not line.startswith("--"):
            raise JobError(f"--sbatch {line!r}: give one sbatch option per --sbatch, e.g. --sbatch=--exclusive")
    gpus = shape.nproc_per_node if opts.gpus_per_node is None else opts.gpus_per_node
    directives = [f"--job-name={opts.job_name}", f"--nodes={shape.nnodes}", "--ntasks-per-node=1"]
    if opts.cpus_per_task:
        directives.append(f"--cpus-per-task={opts.cpus_per_task}")
    if gpus:
        directives.append(f"--gpus-per-node={gpus}")
    directives += [f"--time={opts.time}",
                   f"--signal=B:USR1@{opts.signal_lead_s}",  # the time-limit warning, to this shell (B:) only
                   "--requeue", "--open-mode=append",  # one log across attempts
                   f"--chdir={opts.workdir}", f"--output={opts.output}"]
    if opts.partition:
        directives.append(f"--partition={opts.partition}")
    if opts.account:
        directives.append(f"--account={opts.account}")
    directives += list(opts.sbatch)
    for d in directives:
        if any(c.isspace() for c in d):  # sbatch splits an #SBATCH line at white space
            raise JobError(f"#SBATCH {d!r}: a value holds white space, which an #SBATCH line cannot carry")
    settings = [
        f"WORKDIR={shlex.quote(opts.workdir)}",
        f"PY={shlex.quote(opts.python)}",
        f"RUN_DIR={shlex.quote(shape.run_dir)}",
        f"NPROC_PER_NODE={shape.nproc_per_node}",
        f"MASTER_PORT={opts.master_port if opts.master_port else ''}",
        f"MAX_REQUEUES={opts.max_requeues}",
    ]
    settings += [f"export {k}={shlex.quote(v)}" for k, v in opts.env]
    settings.append(_bash_array("TRAIN_ARGS", shape.train_args))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = f"Written by tools/launch_job.py slurm ({when}). Submit: sbatch THIS_FILE; the same file resumes."
    if command:
        header += "\n# Command: " + command.replace("\n", " ")
    text = _read_template(template or os.path.join(TEMPLATES, "slurm.sbatch"))
    return _fill(text, {"header": header, "directives": "\n".join(f"#SBATCH {d}" for d in directives),
                        "settings": "\n".join(settings)})


def _read_template(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError as exc:
        raise JobError(f"--template {path}: {exc.strerror}") from exc


def _fill(text: str, blocks: dict[str, str]) -> str:
    for name, value in blocks.items():
        token = "{{" + name + "}}"
        if text.count(token) != 1:
            raise JobError(f"the template holds {text.count(token)} {token} blocks; it needs exactly one")
        text = text.replace(token, value)
    left = re.findall(r"\{\{[a-z_]+\}\}", text)
    if left:
        raise JobError(f"the template holds blocks this version does not fill: {', '.join(sorted(set(left)))}")
    return text


# ----------------------------------------------------------------------------------------------- Kubernetes

_K8S_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class K8sOptions:
    image: str
    name: str = "megatron-rl"
    namespace: Optional[str] = None
    gpus_per_node: Optional[int] = None  # None: the run's ranks per node; 0: none asked
    grace_s: int = 300
    max_restarts: int = 3
    master_port: int = 29500
    python: str = "python"
    workdir: Optional[str] = None
    volumes: tuple[tuple[str, str], ...] = ()  # (PVC claim, mount path): where --save and --output-dir live
    env: tuple[tuple[str, str], ...] = ()


def _k8s_escape(arg: str) -> str:
    """Kubernetes expands ``$(VAR)`` in ``command``/``args``; ``$$`` is a literal ``$``. A training flag is
    passed as written."""
    return arg.replace("$", "$$")


def jobset_manifest(shape: RunShape, opts: K8sOptions, *, template: Optional[str] = None) -> dict:
    """The JobSet (a dict for yaml.safe_dump) from tools/launch_templates/jobset.yaml with its FILLED fields set."""
    import yaml  # a core dependency (--config run.yaml)

    # JobSet names its pods <name>-node-<job>-<pod> and its service <name>: DNS labels, 63 characters at most
    if not _K8S_NAME.match(opts.name) or len(opts.name) > 40:
        raise JobError(f"--name {opts.name!r}: lowercase letters, digits and '-', starting with a letter, at most 40 "
                       "characters (pod host names append '-node-0-0')")
    if opts.grace_s < 1:
        raise JobError(f"--grace-seconds {opts.grace_s}: the pods need time to finish a step and save; use 1 or more")
    if opts.max_restarts < 0:
        raise JobError(f"--max-restarts {opts.max_restarts}: use 0 or more")
    for key, _ in opts.env:
        if not _ENV_NAME.match(key):
            raise JobError(f"--env {key!r}: not an environment variable name")
    text = _read_template(template or os.path.join(TEMPLATES, "jobset.yaml"))
    try:
        manifest = yaml.safe_load(text)  # a fresh tree: filled in place
        spec = manifest["spec"]
        rjob = spec["replicatedJobs"][0]
        job_spec = rjob["template"]["spec"]
        pod = job_spec["template"]["spec"]
        container = next(c for c in pod["containers"] if c["name"] == "trainer")
    except (yaml.YAMLError, KeyError, IndexError, TypeError, StopIteration) as exc:
        raise JobError(f"the JobSet template lacks {exc!r}: keep the fields tools/launch_templates/jobset.yaml marks "
                       "FILLED, and a container named trainer") from exc

    manifest["metadata"]["name"] = opts.name
    if opts.namespace:
        manifest["metadata"]["namespace"] = opts.namespace
    spec["failurePolicy"]["maxRestarts"] = opts.max_restarts
    job_spec["parallelism"] = job_spec["completions"] = shape.nnodes
    pod["terminationGracePeriodSeconds"] = opts.grace_s
    master = f"{opts.name}-{rjob['name']}-0-0.{spec.get('network', {}).get('subdomain') or opts.name}"
    container["image"] = opts.image
    container["command"] = [opts.python, "-m", "megatron_rl.infra.launch", "--run-dir", _k8s_escape(shape.run_dir),
                            "--nnodes", str(shape.nnodes), "--node-rank", "$(NODE_RANK)",
                            "--nproc-per-node", str(shape.nproc_per_node), "--master-addr", master,
                            "--master-port", str(opts.master_port), "-m", TRAIN_MODULE,
                            *(_k8s_escape(a) for a in shape.train_args)]
    if opts.workdir:
        container["workingDir"] = opts.workdir
    container.setdefault("env", []).extend({"name": k, "value": v} for k, v in opts.env)
    gpus = shape.nproc_per_node if opts.gpus_per_node is None else opts.gpus_per_node
    if gpus:
        container.setdefault("resources", {}).setdefault("limits", {})["nvidia.com/gpu"] = str(gpus)
    for i, (claim, mount) in enumerate(opts.volumes):
        name = f"run-storage-{i}"
        pod.setdefault("volumes", []).append({"name": name, "persistentVolumeClaim": {"claimName": claim}})
        container.setdefault("volumeMounts", []).append({"name": name, "mountPath": mount})
    return manifest


def jobset_rule_problems(manifest: dict) -> list[str]:
    """What the exit-code semantics need of a JobSet that no schema checks: restartPolicy Never (else the kubelet
    restarts a container in place and no rule sees the exit), backoffLimit 0, and each failurePolicy rule's
    message pattern naming the podFailurePolicy rule of the exit it is for."""
    problems = []
    spec = manifest["spec"]
    job_spec = spec["replicatedJobs"][0]["template"]["spec"]
    pod = job_spec["template"]["spec"]
    if pod.get("restartPolicy") != "Never":
        problems.append("the pod's restartPolicy must be Never (podFailurePolicy needs it)")
    if job_spec.get("backoffLimit") != 0:
        problems.append("the Job's backoffLimit must be 0: a pod failure restarts the whole JobSet, not one pod")
    rules = job_spec.get("podFailurePolicy", {}).get("rules", [])

    def exit_codes(i: int) -> list[int]:
        return rules[i].get("onExitCodes", {}).get("values", []) if i < len(rules) else []

    if exit_codes(K8S_REFUSED_RULE) != [EXIT_REFUSED]:
        problems.append(f"podFailurePolicy rule {K8S_REFUSED_RULE} must be FailJob on exit code {EXIT_REFUSED}")
    if exit_codes(K8S_STOPPED_RULE) != [3]:
        problems.append(f"podFailurePolicy rule {K8S_STOPPED_RULE} must be FailJob on exit code 3")
    by_name = {r["name"]: r for r in spec["failurePolicy"].get("rules", [])}
    wanted = {"refused": ("FailJobSet", [K8S_REFUSED_RULE]),
              "resumable": ("RestartJobSetAndIgnoreMaxRestarts", [K8S_STOPPED_RULE, K8S_DISRUPTED_RULE])}
    for name, (action, indexes) in wanted.items():
        rule = by_name.get(name)
        patterns = [f"matching FailJob rule at index {i}$" for i in indexes]
        if rule is None or rule.get("action") != action or rule.get("onJobFailureMessagePatterns") != patterns:
            problems.append(f"failurePolicy rule {name!r} must be {action} on {patterns}")
    return problems


def jobset_schema_problems(manifest: dict) -> Optional[list[str]]:
    """The manifest against the JobSet v1alpha2 API models that ``kubeflow-trainer-api`` ships (generated from
    JobSet's and Kubernetes' OpenAPI: batch/v1 Job, podFailurePolicy, core/v1 Pod): types, enums, required
    fields, and -- the models drop what they do not know and fill a missing required field with '' -- a round
    trip that must give the manifest back unchanged, which names a misspelled or missing field. None when the
    package is not installed (an extra of the tests: pip install kubeflow-trainer-api)."""
    try:
        from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet
    except ImportError:
        return None
    from pydantic import ValidationError

    try:
        back = JobsetV1alpha2JobSet.from_dict(manifest)
    except ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    assert back is not None, "from_dict returns None only for None"
    return [f"{path}: {what}" for path, what in _differences(manifest, back.to_dict())]


def _differences(given, back, path: str = "") -> list[tuple[str, str]]:
    if isinstance(given, dict) and isinstance(back, dict):
        out = [(f"{path}.{k}", "not a field of the API (misspelled?)") for k in given if k not in back]
        out += [(f"{path}.{k}", "required by the API but missing") for k in back if k not in given]
        for k in given.keys() & back.keys():
            out += _differences(given[k], back[k], f"{path}.{k}")
        return out
    if isinstance(given, list) and isinstance(back, list) and len(given) == len(back):
        return [d for i, (g, b) in enumerate(zip(given, back)) for d in _differences(g, b, f"{path}[{i}]")]
    return [] if given == back else [(path or ".", f"{given!r} reads back as {back!r}")]


# ---------------------------------------------------------------------------------------------------- the CLI

def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: use KEY=VALUE")
    return key, value


def _volume(text: str) -> tuple[str, str]:
    claim, sep, mount = text.partition(":")
    if not sep or not claim or not mount.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text!r}: use PVC_NAME:/mount/path")
    return claim, mount


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="launch_job.py", allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="End the options with -m megatron_rl.train <training flags>.")
    sub = ap.add_subparsers(dest="scheduler", required=True)
    for name in ("slurm", "k8s"):
        p = sub.add_parser(name, allow_abbrev=False)
        p.add_argument("--out", metavar="FILE", help="write here (default: standard output)")
        p.add_argument("--template", metavar="FILE", help="a site's copy of tools/launch_templates/"
                       + ("slurm.sbatch" if name == "slurm" else "jobset.yaml"))
        p.add_argument("--gpus-per-node", type=int, help="GPUs to ask per node (default: --actor-num-gpus-per-node; "
                       "0 for CPU nodes; more when launched SGLang engines take GPUs beyond the trainer's)")
        p.add_argument("--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
                       help="an environment variable for the run (repeat)")
        p.add_argument("--no-validate", action="store_true",
                       help="only parse the training flags (a submit host that cannot see the cluster's paths)")
        if name == "slurm":
            p.add_argument("--time", required=True, help="sbatch --time: the limit of one attempt")
            p.add_argument("--signal-lead", type=int, default=300, metavar="SECONDS",
                           help="USR1 this long before the time limit: enough to finish a step and save (300)")
            p.add_argument("--job-name", default="megatron-rl")
            p.add_argument("--partition")
            p.add_argument("--account")
            p.add_argument("--cpus-per-task", type=int, help="CPUs for each node's task (all its ranks)")
            p.add_argument("--output", default="%x-%j.out", help="sbatch --output, relative to --workdir "
                           "(default %%x-%%j.out; appended across attempts)")
            p.add_argument("--max-requeues", type=int, default=50,
                           help="exit-3 requeues before the job stops requeueing itself (50)")
            p.add_argument("--master-port", type=int, help="default: one per job and attempt, from the job id")
            p.add_argument("--python", default=sys.executable, help="the interpreter on the nodes (default: this one)")
            p.add_argument("--workdir", default=os.getcwd(), help="where the job runs (default: here)")
            p.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                           help="one more #SBATCH line, e.g. --sbatch=--exclusive (repeat)")
        else:
            p.add_argument("--image", required=True, help="a container image with megatron_rl installed")
            p.add_argument("--name", default="megatron-rl", help="the JobSet's name (DNS label)")
            p.add_argument("--namespace")
            p.add_argument("--grace-seconds", type=int, default=300,
                           help="terminationGracePeriodSeconds: finish a step and save after SIGTERM (300)")
            p.add_argument("--max-restarts", type=int, default=3, help="crash restarts before the JobSet fails (3)")
            p.add_argument("--master-port", type=int, default=29500)
            p.add_argument("--python", default="python", help="the interpreter in the image")
            p.add_argument("--workdir", help="the container's working directory (relative paths in the flags)")
            p.add_argument("--volume", type=_volume, action="append", default=[], metavar="PVC:/MOUNT",
                           help="a PersistentVolumeClaim every pod mounts, for --save and --output-dir (repeat)")
    return ap


def render(argv: list[str]) -> tuple[str, Optional[str]]:
    """(the job file's text, where to write it: --out or None) for a command line; JobError/ConfigError on a
    refusal."""
    options, train_args = split_command(argv)
    ns = build_parser().parse_args(options)
    if ns.gpus_per_node is not None and ns.gpus_per_node < 0:
        raise JobError(f"--gpus-per-node {ns.gpus_per_node}: use 0 or more")
    shape = run_shape(train_args, validate=not ns.no_validate)
    if ns.scheduler == "slurm":
        opts = SlurmOptions(time=ns.time, signal_lead_s=ns.signal_lead, job_name=ns.job_name, partition=ns.partition,
                            account=ns.account, gpus_per_node=ns.gpus_per_node, cpus_per_task=ns.cpus_per_task,
                            output=ns.output, max_requeues=ns.max_requeues, master_port=ns.master_port,
                            python=ns.python, workdir=os.path.abspath(ns.workdir), env=tuple(ns.env),
                            sbatch=tuple(ns.sbatch))
        command = shlex.join(["tools/launch_job.py", *argv])
        return slurm_script(shape, opts, template=ns.template, command=command), ns.out
    import yaml

    k8s = K8sOptions(image=ns.image, name=ns.name, namespace=ns.namespace, gpus_per_node=ns.gpus_per_node,
                     grace_s=ns.grace_seconds, max_restarts=ns.max_restarts, master_port=ns.master_port,
                     python=ns.python, workdir=ns.workdir, volumes=tuple(ns.volume), env=tuple(ns.env))
    manifest = jobset_manifest(shape, k8s, template=ns.template)
    problems = jobset_rule_problems(manifest)
    if problems:
        raise JobError("the JobSet template breaks the exit-code semantics:\n  - " + "\n  - ".join(problems))
    schema = jobset_schema_problems(manifest)
    if schema:
        raise JobError("the JobSet does not match the JobSet v1alpha2 API:\n  - " + "\n  - ".join(schema))
    checked = ("checked against the JobSet v1alpha2 API models of kubeflow-trainer-api" if schema is not None else
               "NOT checked against the API: pip install kubeflow-trainer-api to check it")
    text = (f"# Written by tools/launch_job.py k8s ({checked}).\n"
            "# Apply: kubectl apply -f THIS_FILE (needs the JobSet controller, 0.10 or newer)\n"
            + yaml.safe_dump(manifest, sort_keys=False, width=1000))
    return text, ns.out


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        text, out = render(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if out:
        with open(out, "w") as fh:
            fh.write(text)
        if text.startswith("#!"):
            os.chmod(out, 0o755)  # the batch script runs as a program too (bash FILE under salloc)
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
