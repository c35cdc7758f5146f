"""Training choices measured side by side (`scripts/ablate.py`): one run of a recipe per arm (the same base
config, data and step budget, one arm's overrides on top), then every arm's head decoded greedily on the same
held-out prompts. Runs are resumable: a finished arm is skipped, an interrupted one resumes from its last
state (the recipe's own resume). With `hidden_states: offline` the target's hidden states over the training
data are dumped once into output_dir/states (`scripts/dump_hidden_states.py`, resumable too) and every arm
trains on them (`data.hidden_states=offline`): the target's forward, most of an online step on a CPU, is paid
once instead of once per arm, and an arm's training seconds are then its draft's own cost.

The spec is a YAML file:

    recipe: eagle                      # train/eagle.py or train/medusa.py
    base: configs/eagle3_smollm2.yaml  # the recipe config every arm starts from
    overrides: [train.max_steps=600]   # applied to every arm (data, budget, evaluation off, ...)
    output_dir: runs/ablation          # one folder per arm (~ is expanded)
    hidden_states: offline             # optional (eagle): dump the target's states once, every arm reads them
    prompts: 10                        # held-out prompts per category
    new_tokens: 64
    heldout: true                      # optional: also the held-out-source categories, pooled per kind
    chain: 3                           # optional: also judged with a chain of 3 drafts (what vLLM serves)
    seen: [data/smollm2/regen_broad/shard-*.jsonl]  # optional, with heldout: also the held-out kinds'
                                       # prompts in these training chats (benchmarks.prompts.SEEN_SOURCES)
    references:                        # optional: heads trained elsewhere, judged beside the arms
      shipped: pretrained/smollm2-135m-instruct/eagle3   # (relative to the repository root)
    arms:                              # name -> its own overrides; the first is the reference
      baseline: []
      ttt5: [eagle.ttt_steps=5]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from heads.files import write_json, write_text
from train.checkpoint import BEST_DIR

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("eagle", "medusa")
DONE = "ablation_done.json"  # written in an arm's folder when its run finished
DUMPED = "dump_done.json"  # written in the states folder when the dump finished (with its seconds)
HIDDEN_STATES = ("online", "offline")
SPENT = "ablation_seconds.json"  # training seconds of an arm's launches so far


@dataclass(kw_only=True)
class AblationSpec:
    recipe: str
    base: Path
    output_dir: Path
    arms: dict[str, list[str]]
    overrides: list[str] = field(default_factory=list)
    prompts: int = 10
    new_tokens: int = 64
    hidden_states: str = "online"
    heldout: bool = False  # also judge on the held-out-source categories (benchmarks.prompts.load_prompts)
    # also judge with a chain of this many top-1 drafts (vLLM's num_speculative_tokens)
    chain: int | None = None
    references: dict[str, Path] = field(default_factory=dict)  # name -> a head folder judged, not trained
    # globs of training chats (relative to the repository): also judge on held-out kinds' prompts trained on
    seen: list[str] = field(default_factory=list)

    @property
    def states_dir(self) -> Path | None:
        """Where an offline spec's hidden states go (None when online)."""
        return self.output_dir / "states" if self.hidden_states == "offline" else None

    @property
    def seen_files(self) -> list[Path]:
        """The training chats `seen` globs (under the repository), sorted, each once; ValueError naming a glob
        that matches no file."""
        files = set()
        for pattern in self.seen:
            matched = set(ROOT.glob(pattern))
            if not matched:
                raise ValueError(f"seen glob {pattern!r} matches no file under {ROOT}")
            files |= matched
        return sorted(files)

    @property
    def common_overrides(self) -> list[str]:
        """The overrides every arm gets: the spec's, plus reading the dumped states when offline."""
        if self.states_dir is None:
            return list(self.overrides)
        return [*self.overrides, "data.hidden_states=offline", f"data.offline_dir={self.states_dir}"]


def load_spec(path: str | Path) -> AblationSpec:
    """The spec in the YAML file `path`; ValueError (TypeError for a file that is not a mapping) naming the
    file and the key on anything wrong."""
    path = Path(path)
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise TypeError(f"{path}: expected a mapping of spec keys, found {type(raw).__name__}")
    known = set(AblationSpec.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; expected some of {sorted(known)}")
    missing = sorted(k for k in ("recipe", "base", "output_dir", "arms") if k not in raw)
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}")
    if raw["recipe"] not in RECIPES:
        raise ValueError(f"{path}: recipe {raw['recipe']!r}, expected one of {list(RECIPES)}")
    arms = raw["arms"]
    if not isinstance(arms, dict) or not arms:
        raise ValueError(f"{path}: arms must be a non-empty mapping of name -> list of overrides")
    for name, extra in arms.items():
        if not isinstance(extra, list) or not all(isinstance(o, str) and "=" in o for o in extra):
            raise ValueError(f"{path}: arm {name!r} must list 'section.key=value' overrides, found {extra!r}")
        if "/" in str(name) or any(o.startswith("train.output_dir=") for o in extra):
            raise ValueError(f"{path}: arm {name!r}: its folder is output_dir/<name>, not set by an override")
    references = raw.get("references") or {}
    if not isinstance(references, dict) or not all(isinstance(v, str) for v in references.values()):
        raise ValueError(f"{path}: references must map names to head folders, found {references!r}")
    clash = sorted(set(map(str, references)) & set(map(str, arms)))
    if clash:
        raise ValueError(f"{path}: reference(s) {clash} named like arms; give them other names")
    if raw.get("hidden_states", "online") not in HIDDEN_STATES:
        raise ValueError(
            f"{path}: hidden_states {raw['hidden_states']!r}, expected one of {list(HIDDEN_STATES)}"
        )
    if raw.get("hidden_states") == "offline" and raw["recipe"] != "eagle":
        raise ValueError(
            f"{path}: hidden_states: offline needs recipe eagle (its dump), found {raw['recipe']!r}"
        )
    if not isinstance(raw.get("heldout", False), bool):
        raise TypeError(f"{path}: heldout must be true or false, found {raw['heldout']!r}")
    seen = raw.get("seen") or []
    if not isinstance(seen, list) or not all(isinstance(g, str) for g in seen):
        raise ValueError(f"{path}: seen must list globs of training chats, found {seen!r}")
    if seen and not raw.get("heldout", False):
        raise ValueError(f"{path}: seen needs heldout: true (it is judged beside the held-out kinds)")
    for key in ("prompts", "new_tokens", "chain"):
        if key == "chain" and raw.get(key) is None:
            continue
        if key in raw and (isinstance(raw[key], bool) or not isinstance(raw[key], int) or raw[key] < 1):
            raise ValueError(f"{path}: {key} must be a positive integer, found {raw[key]!r}")
    return AblationSpec(
        recipe=raw["recipe"],
        base=Path(raw["base"]),
        output_dir=Path(raw["output_dir"]).expanduser(),
        arms={str(k): list(v) for k, v in arms.items()},
        overrides=list(raw.get("overrides") or []),
        prompts=raw.get("prompts", 10),
        new_tokens=raw.get("new_tokens", 64),
        hidden_states=raw.get("hidden_states", "online"),
        heldout=raw.get("heldout", False),
        chain=raw.get("chain"),
        references={str(k): ROOT / Path(v).expanduser() for k, v in references.items()},
        seen=list(seen),
    )


def arm_command(spec: AblationSpec, name: str) -> list[str]:
    """The recipe command line of arm `name` (one process; the same for a rerun, so it resumes)."""
    out = spec.output_dir / name
    return [
        sys.executable,
        str(ROOT / "train" / f"{spec.recipe}.py"),
        str(spec.base),
        *spec.common_overrides,
        *spec.arms[name],
        f"train.output_dir={out}",
    ]


def dump_command(spec: AblationSpec) -> list[str]:
    """The command that dumps an offline spec's hidden states (the base config and the common overrides: the
    data every arm trains on)."""
    if spec.states_dir is None:
        raise ValueError("the spec trains online: no hidden states to dump")
    script = ROOT / "scripts" / "dump_hidden_states.py"
    return [
        sys.executable,
        str(script),
        str(spec.base),
        *spec.overrides,
        f"data.offline_dir={spec.states_dir}",
    ]


def dump_states(spec: AblationSpec, log=print) -> float:
    """Dump an offline spec's hidden states unless done before (an interrupted dump resumes); returns the
    seconds the dump took (all its launches)."""
    done = spec.states_dir / DUMPED
    command = dump_command(spec)
    if done.is_file():
        seconds = _done_before(done, command, "the hidden-state dump")["seconds"]
        log(f"[states] dumped before ({seconds:.0f} s): {spec.states_dir}")
        return seconds
    log("[states] " + " ".join(command[1:]))
    seconds = _launch(command, spec.states_dir, "dump.log", "the hidden-state dump")
    write_json(done, {"seconds": seconds, "args": command[2:]})
    return seconds


def _done_before(done: Path, command: list[str], what: str) -> dict:
    """The record of a finished dump or arm, when the config and overrides (`args`) that made it are those of
    `command` now; a spec whose base, common overrides or arm changed since would table the old run beside
    the new settings, so that is a ValueError naming both."""
    record = json.loads(done.read_text())
    if record.get("args") != command[2:]:
        raise ValueError(
            f"{what} in {done.parent} was made by {record.get('args')}, but the spec now runs "
            f"{command[2:]}: remove {done.parent} to run it again, or restore the spec"
        )
    return record


def _launch(command: list[str], folder: Path, log_name: str, what: str) -> float:
    """Run `command` from the repository root, appending its output to folder/log_name; returns the seconds of
    all its launches so far (an interrupted command resumes when launched again, its earlier time kept in
    folder/SPENT). RuntimeError with the log's tail when it fails."""
    folder.mkdir(parents=True, exist_ok=True)
    spent = folder / SPENT
    before = json.loads(spent.read_text())["seconds"] if spent.is_file() else 0.0
    start = time.perf_counter()
    try:
        with (folder / log_name).open("a") as stream:
            run = subprocess.run(command, cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT, check=False)
    finally:  # also when interrupted (Ctrl-C); a killed runner loses this launch's time only
        seconds = before + time.perf_counter() - start
        write_json(spent, {"seconds": seconds})
    if run.returncode != 0:
        tail = "\n".join((folder / log_name).read_text().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {run.returncode}); {folder / log_name} ends:\n{tail}")
    return seconds


def check_arms(spec: AblationSpec, names) -> None:
    """Every arm of `names` loads as a run config of the spec's recipe (its base, the common overrides, its
    own): ValueError naming the arm and the problem otherwise. Checked in this process before any arm trains,
    so an arm with a bad override fails at once, not when its turn comes hours later."""
    from train.config import EagleRunConfig, MedusaRunConfig, load_config

    cls = {"eagle": EagleRunConfig, "medusa": MedusaRunConfig}[spec.recipe]
    for name in names:
        try:
            load_config(cls, ROOT / spec.base, arm_command(spec, name)[3:])  # as launched: from ROOT
        except (TypeError, ValueError) as error:
            raise ValueError(f"arm {name!r} ({spec.arms[name]}): {error}") from error


def run_arm(spec: AblationSpec, name: str, log=print) -> dict:
    """Train arm `name` unless it finished before; returns its record ({"arm", "overrides", "seconds"}, the
    seconds of all its launches, resumed ones included). Its config is checked first (`check_arms`)."""
    out = spec.output_dir / name
    done = out / DONE
    command = arm_command(spec, name)
    if done.is_file():
        record = _done_before(done, command, f"arm {name!r}")
        log(f"[{name}] done before ({record['seconds']:.0f} s of training): skipped")
        return record
    check_arms(spec, [name])
    log(f"[{name}] " + " ".join(command[1:]))
    seconds = _launch(command, out, "train.log", f"arm {name!r}")
    record = {"arm": name, "overrides": spec.arms[name], "seconds": seconds, "args": command[2:]}
    write_json(done, record)
    return record


def reference_record(spec: AblationSpec, name: str) -> dict:
    """The record of reference `name` (a head trained elsewhere: judged as it is, with no training seconds);
    FileNotFoundError naming the folder when it holds no head."""
    folder = spec.references[name]
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"reference {name!r}: no head in {folder} (no config.json)")
    return {"arm": name, "overrides": [], "seconds": None, "head_dir": str(folder)}


def _pooled_tau(
    model, tokenizer, head, rows: list[dict], new_tokens: int, batch_size: int, tree=None
) -> dict:
    """Greedy decoding with `tree` (None: the head's default tree) on chat-template prompts
    (`decode.generate.decode_prompts`, `batch_size` prompts per batch: the same tokens and steps as one at a
    time): pooled tau (tokens emitted by verify passes / verify passes, the bonus token counted, the prefill's
    token left out, as `benchmarks.benchmark` pools it) and the median of per-prompt taus."""
    from benchmarks.prompts import prompt_ids  # train -> benchmarks: allowed; lazy, as in evaluate.py
    from decode.generate import decode_prompts
    from train.data import pad_token_id

    prompts = [prompt_ids(tokenizer, row).to(model.device)[0] for row in rows]
    results = decode_prompts(
        model,
        prompts,
        head,
        max_new_tokens=new_tokens,
        batch_size=batch_size,
        pad_token_id=pad_token_id(tokenizer),
        tree=tree,
    )
    emitted = sum(len(r.reply) - 1 for r in results)
    steps = sum(r.steps for r in results)
    record = {
        "tau": emitted / steps if steps else 1.0,
        "tau_median": statistics.median(r.tau for r in results),
        "prompts": len(rows),
        "emitted": emitted,
        "steps": steps,
        "taus": [r.tau for r in results],
    }
    t2d = getattr(head, "t2d", None)  # a draft vocabulary of its own: how many reply tokens lie outside it
    if t2d is not None and head.config.draft_vocab_size < head.config.vocab_size:
        replies = [torch.as_tensor(r.reply, device=t2d.device) for r in results]
        record["tokens"] = sum(int(reply.numel()) for reply in replies)
        record["outside"] = sum(int((~t2d[reply]).sum()) for reply in replies)
    return record


def _pool(parts: list[dict]) -> dict:
    """One record pooling `_pooled_tau` records: emitted tokens over verify steps of every prompt."""
    emitted, steps = sum(p["emitted"] for p in parts), sum(p["steps"] for p in parts)
    every = [t for p in parts for t in p["taus"]]
    pooled = {
        "tau": emitted / steps if steps else 1.0,
        "tau_median": statistics.median(every) if every else 1.0,
        "prompts": len(every),
        "emitted": emitted,
        "steps": steps,
        "taus": every,
    }
    if parts and all("outside" in p for p in parts):
        pooled |= {key: sum(p[key] for p in parts) for key in ("tokens", "outside")}
    return pooled


def _ratio(out: dict, over: str, under: str) -> None:
    """The row "<over> / <under>": the ratio of their pooled taus, and of their medians of prompts (the
    table's bracket)."""
    ratio = out[over]["tau"] / out[under]["tau"] if out[under]["steps"] else float("nan")
    medians = out[over]["tau_median"] / out[under]["tau_median"] if out[under]["steps"] else float("nan")
    out[f"{over} / {under}"] = {"tau": ratio, "tau_median": medians, "prompts": 0}


def pooled_kinds(taus: dict[str, dict]) -> dict[str, dict]:
    """`taus` ({category: `_pooled_tau` record}) with, when it holds held-out-source categories, the pooled
    "in-source" and "held-out" records and their ratio ("held-out / in-source": what generalisation is judged
    by); when it holds seen categories (`benchmarks.prompts.load_seen_prompts`), their pooled "seen" record
    and "held-out / seen": the held-out kinds' tau over their tau on prompts trained on, which leaves out what
    the kind of text costs."""
    # lazy, as in `_pooled_tau`
    from benchmarks.prompts import CATEGORIES, HELDOUT_CATEGORIES, SEEN, SEEN_SOURCES

    out = dict(taus)
    if not any(c in taus for c in HELDOUT_CATEGORIES):
        return out
    kinds = {"in-source": CATEGORIES, "held-out": HELDOUT_CATEGORIES}
    kinds[SEEN] = tuple(f"{SEEN}_{k}" for k in SEEN_SOURCES)
    for kind, names in kinds.items():
        if kind != SEEN or any(c in taus for c in names):
            out[kind] = _pool([taus[c] for c in names if c in taus])
    _ratio(out, "held-out", "in-source")
    if SEEN in out:
        _ratio(out, "held-out", SEEN)
    return out


def evaluate_arm(
    model,
    tokenizer,
    head_dir: Path,
    prompts: dict[str, list[dict]],
    new_tokens: int,
    batch_size: int = 1,
    tree=None,
) -> dict:
    """{category: pooled tau record} of the head in `head_dir` on `prompts` ({category: rows}), decoded
    `batch_size` prompts at a time with `tree` (None: the head's default tree)."""
    from heads import load_heads

    head = load_heads(head_dir, model)
    with torch.no_grad():
        return pooled_kinds(
            {
                category: _pooled_tau(model, tokenizer, head, rows, new_tokens, batch_size, tree)
                for category, rows in prompts.items()
            }
        )


def arm_heads(arm_dir: Path) -> list[Path]:
    """The heads an arm is judged by: the last step's `head/`, and `head_best/` too when its run selected
    checkpoints by simulated tau (`train.keep_best_tau`)."""
    best = arm_dir / BEST_DIR
    return [arm_dir / "head"] + ([best] if (best / "config.json").is_file() else [])


def recorded_tau(head_dir: Path) -> float | None:
    """The simulated tau on the run's held-out slice that the recipe recorded in the head's config.json (its
    last evaluation, or the best one for `head_best/`); None when the run measured none."""
    return json.loads((head_dir / "config.json").read_text()).get("eval_tau")


@torch.no_grad()
def draft_cost_ms(model, tokenizer, head_dir: Path, row: dict, repeats: int = 15) -> float:
    """Milliseconds of the drafter's work in one greedy decoding step with the default tree (taking in two
    accepted positions, then drafting), after prefilling the chat prompt `row`: the CPU price of an arm's
    head (a larger draft vocabulary costs a larger draft lm_head); `decode.calibrate.measure_propose_cost`."""
    from benchmarks.prompts import prompt_ids
    from decode.calibrate import measure_propose_cost
    from decode.drafters import make_drafter
    from decode.tree import resolve_tree
    from heads import load_heads

    head = load_heads(head_dir, model)
    limits = make_drafter(head, model, 1).limits()
    tree = resolve_tree(None, max_depth=limits.max_depth, dynamic=limits.dynamic, device=model.device)
    context = prompt_ids(tokenizer, row).to(model.device)  # (1, T)
    return 1000 * measure_propose_cost(model, head, context, [tree], repeats=repeats)[0]


def judge_arm(
    model, tokenizer, spec: AblationSpec, record: dict, prompts: dict[str, list[dict]]
) -> list[dict]:
    """An arm's results, one per head it is judged by (`arm_heads`; a reference's own folder): its training
    record, the head, the simulated tau its run recorded for it, its draft cost (on the first chat prompt, or
    the first prompt of any category), its tau per category and, when the spec names a chain, its tau per
    category with that chain ("chain_tau")."""
    from decode.tree import chain  # lazy, as in `_pooled_tau`

    first = next(iter(prompts.get("chat") or [r for rows in prompts.values() for r in rows]))
    folders = (
        [Path(record["head_dir"])] if "head_dir" in record else arm_heads(spec.output_dir / record["arm"])
    )
    results = []
    for head_dir in folders:
        result = {
            **record,
            "head": head_dir.name,
            "eval_tau": recorded_tau(head_dir),
            "draft_ms": draft_cost_ms(model, tokenizer, head_dir, first),
            # each category's prompts in one batch: the same tokens and steps, a third of the time (measured)
            "tau": evaluate_arm(
                model, tokenizer, head_dir, prompts, spec.new_tokens, batch_size=spec.prompts
            ),
        }
        if spec.chain is not None:
            result["chain_tau"] = evaluate_arm(
                model, tokenizer, head_dir, prompts, spec.new_tokens, spec.prompts, tree=chain(spec.chain)
            )
        results.append(result)
    return results


def render(spec: AblationSpec, results: list[dict], dump_seconds: float | None = None) -> str:
    """A markdown table: one row per arm, its overrides, training seconds, the head judged, the simulated tau
    its run recorded, the draft cost per step and tau per category (and, offline, what the dump took)."""
    categories = list(results[0]["tau"]) if results else []
    # with a chain: its tau on chat and on each kind of source (every category is in ablation.json)
    chained = (
        [c for c in ("chat", "in-source", "held-out") if c in results[0].get("chain_tau", {})]
        if results
        else []
    )
    head = ["arm", "overrides", "train s", "head", "sim tau", "draft ms", *(f"{c} tau" for c in categories)]
    head += [f"chain-{spec.chain} {c} tau" for c in chained]
    # the share of reply tokens outside a head's draft vocabulary (never drafted), per kind of source
    outside = [
        c for c in ("in-source", "held-out", "seen") if any("outside" in r["tau"].get(c, {}) for r in results)
    ]
    head += [f"{c} outside vocab" for c in outside]
    title = (
        f"Ablation of `{spec.base}` ({spec.recipe}), common overrides: `{' '.join(spec.overrides) or '-'}`; "
        f"greedy `decode.generate`, default tree, {spec.prompts} held-out prompts per category, "
        f"{spec.new_tokens} new tokens; tau pooled (median of prompts in brackets). sim tau: the median "
        "simulated tau on the run's held-out slice, as its last (or, for head_best, its best) evaluation "
        "recorded it; draft ms: the drafter's median milliseconds per greedy step with the default tree on "
        "this machine."
    )
    if chained:
        title += (
            f" chain-{spec.chain}: tau with a chain of {spec.chain} top-1 drafts (what vLLM serves with "
            f"num_speculative_tokens={spec.chain}), the same prompts."
        )
    if outside:
        title += (
            " outside vocab: the share of the replies' tokens that lie outside the head's draft vocabulary "
            "(it can never draft them)."
        )
    if spec.states_dir is not None:
        took = "" if dump_seconds is None else f" ({dump_seconds:.0f} s, once)"
        title += (
            f" Offline: every arm read the target's hidden states dumped into `{spec.states_dir}`{took}; "
            "train s is the draft's training alone."
        )
    lines = [
        title,
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results:
        taus = [f"{r['tau'][c]['tau']:.2f} ({r['tau'][c]['tau_median']:.2f})" for c in categories]
        taus += [f"{r['chain_tau'][c]['tau']:.2f} ({r['chain_tau'][c]['tau_median']:.2f})" for c in chained]
        taus += [_share(r["tau"].get(c, {})) for c in outside]
        overrides = " ".join(f"`{o}`" for o in r["overrides"]) or "(reference)"
        if (
            "head_dir" in r
        ):  # a head trained elsewhere, by its folder (relative to the repository when inside)
            folder = Path(r["head_dir"])
            overrides = f"head `{folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder}`"
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:.0f}"
        sim = "-" if r.get("eval_tau") is None else f"{r['eval_tau']:.2f}"
        cost = "-" if r.get("draft_ms") is None else f"{r['draft_ms']:.1f}"
        judged = r.get("head", "head")
        lines.append(
            f"| {r['arm']} | {overrides} | {seconds} | {judged} | {sim} | {cost} | " + " | ".join(taus) + " |"
        )
    return "\n".join(lines) + "\n"


def _share(record: dict) -> str:
    return f"{100 * record['outside'] / record['tokens']:.1f}%" if record.get("tokens") else "-"


def write_results(
    spec: AblationSpec, results: list[dict], dump_seconds: float | None = None
) -> tuple[Path, Path]:
    """ablation.json and ablation.md in the spec's output folder (made here when only references were
    judged: no arm has trained into it)."""
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    table = spec.output_dir / "ablation.md"
    data = spec.output_dir / "ablation.json"
    summary = {"base": str(spec.base), "overrides": spec.common_overrides, "results": results}
    write_json(data, summary | ({"dump_seconds": dump_seconds} if dump_seconds is not None else {}))
    write_text(table, render(spec, results, dump_seconds))
    return data, table
