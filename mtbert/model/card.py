"""Model cards in the Hugging Face format (YAML metadata, then prose), written from the pipeline's own
params and metrics: `README.md` in each `models/<variant>/` (by `train`), in each distilled student's
`models/<student>/` (by `distill`) and in `data/ensemble/` (by `ensemble`). The metadata's `model-index`
holds the dev metrics, so a hub or a script reads them back."""

from __future__ import annotations

import yaml

from mtbert.data.tasks import Task
from mtbert.io import rounded

CARD_FILE = "README.md"

# What a user of a model card must know about a backbone the pipeline ships with.
SEEN_QUORA = ("The backbone was trained for sentence embeddings on about a billion sentence pairs, among them "
              "Quora duplicate questions: it has seen Quora questions, possibly some of this project's QQP split, "
              "so QQP figures may be optimistic and are not comparable with published CS224N results.")
BACKBONE_NOTES = {"sentence-transformers/all-MiniLM-L6-v2": SEEN_QUORA,
                  "sentence-transformers/all-mpnet-base-v2": SEEN_QUORA}
KIND_PIPELINE = {"classification": "text-classification", "binary": "text-classification",
                 "regression": "sentence-similarity"}


def model_index(name: str, tasks: dict[str, Task], dev: dict) -> list[dict]:
    """The `model-index` metadata: every task's dev metrics."""
    results = [{"task": {"type": KIND_PIPELINE[task.kind.name], "name": task_name},
                "dataset": {"name": f"{task.file_prefix} (CS224N split)", "type": task.file_prefix, "split": "dev"},
                "metrics": [{"type": metric, "value": rounded(value), "name": f"dev {metric}"}  # as metrics files
                            for metric, value in dev[task_name].items()]}
               for task_name, task in tasks.items()]
    return [{"name": name, "results": results}]


def metadata(name: str, params: dict, tasks: dict[str, Task], dev: dict, encoders: list[str] | None = None) -> str:
    """The card's YAML header; `encoders`: the base models, where not params' one (an ensemble's members)."""
    encoders = encoders or [params["model"]["name"]]
    fields = {"base_model": encoders[0] if len(encoders) == 1 else encoders, "license": params["model"]["license"],
              "language": ["en"],
              "library_name": "transformers", "tags": ["mtbert", "multitask", *sorted(set(KIND_PIPELINE.values()))],
              "datasets": [task.file_prefix for task in tasks.values()], "model-index": model_index(name, tasks, dev)}
    return "---\n" + yaml.safe_dump(fields, sort_keys=False, allow_unicode=True) + "---\n"


def metrics_table(tasks: dict[str, Task], dev: dict, epochs: dict[str, int] | None = None) -> str:
    lines = ["| task | metric | dev |" + (" epoch kept |" if epochs else ""),
             "|---|---|---|" + ("---|" if epochs else "")]
    for name in tasks:
        for metric, value in dev[name].items():
            lines.append(f"| {name} | {metric} | {value:.4f} |" + (f" {epochs[name]} |" if epochs else ""))
    return "\n".join(lines) + "\n"


def usage(path: str, tasks: dict[str, Task], ensemble: bool = False) -> str:
    """How to run the model on new text: the command and the Python call, on the first task."""
    task = next(iter(tasks.values()))
    texts = ["A man plays a guitar.", "A man is playing music."] if task.is_pair else ["A gorgeous, witty film."]
    arguments = " ".join(f'"{text}"' for text in texts)
    example = f"[({', '.join(map(repr, texts))})]" if task.is_pair else f"[{texts[0]!r}]"
    if ensemble:
        command = f"mtbert predict --ensemble {path} --task {task.name} {arguments}"
        load = f"from mtbert.inference import EnsemblePredictor\npredictor = EnsemblePredictor.load({path!r})"
    else:
        command = f"mtbert predict --model {path} --task {task.name} {arguments}"
        load = f"from mtbert.inference import Predictor\npredictor = Predictor.load({path!r})"
    return f"```bash\n{command}\n```\n\n```python\n{load}\npredictor.predict({task.name!r}, {example})\n```\n"


def limitations(params: dict, encoders: list[str] | None = None) -> str:
    lines = ["- Dev figures are the ones model selection saw (each task's epoch was chosen on dev); the "
             "ensemble's honest split-half estimate in `metrics/ensemble.json` is the fairer guess for new text.",
             "- English only; trained on short sentences (movie-review snippets, Quora questions, STS pairs), "
             f"truncated to {params['tokenize']['max_length']} tokens."]
    for encoder in encoders or [params["model"]["name"]]:
        if encoder in BACKBONE_NOTES:
            lines.append(f"- {BACKBONE_NOTES[encoder]}")
    return "\n".join(lines) + "\n"


def variant_card(summary: dict, params: dict, tasks: dict[str, Task], path: str, *, title: str | None = None,
                 notes: str = "") -> str:
    """A trained variant's card, from its training summary and merged params; `title` and `notes` (a section
    before the metrics) for a distilled student."""
    name, dev = summary["variant"], summary["dev"]
    train = params["train"]
    return (metadata(name, params, tasks, {task: dev[task] for task in tasks}) +
            f"\n# {title or f'mtbert variant `{name}`'}\n\n"
            f"`{params['model']['name']}` fine-tuned jointly on {', '.join(tasks)} by the mtbert pipeline "
            f"(architecture `{params['model']['arch']}`, {summary['parameters']:,} parameters). Each task's "
            f"predictions come from the epoch where its dev metric was best (`train.select: {train['select']}`).\n\n"
            + notes +
            "## Dev metrics\n\n" + metrics_table(tasks, dev, summary["task_epochs"]) +
            f"\nOverall (mean of the headline metrics): {dev['overall']:.4f}.\n\n"
            "## Training\n\n"
            f"- {train['epochs']} epochs, lr {train['lr']}, batch {train['batch_size']}, sampler {train['sampler']}, "
            f"weight decay {train['weight_decay']}, layer decay {train['layer_decay']}, seed {train['seed']}, "
            f"bf16 {train['bf16']}; SMART λ {params['smart']['lambda']}"
            + (f"; the weights' moving average (decay {train['ema']}) is the model" if train.get("ema") else "")
            + ".\n"
            # no wall time here: the folder's bytes depend on its inputs alone (the metrics file has the time)
            f"- Trained on {summary['speed']['processes']} process(es); its time and speed are in "
            f"`metrics/train/{name}.json`, all params in `mtbert.json`.\n\n"
            "## Intended use\n\nSentiment (5 classes), paraphrase detection and semantic similarity of short "
            "English sentences, for research and teaching; not for decisions about people.\n\n"
            "## How to use\n\n" + usage(path, tasks) +
            "\nEach `epoch-<E>/encoder/` is a plain `save_pretrained` folder: `AutoModel.from_pretrained` loads "
            "the encoder alone; the heads need this project's code.\n\n"
            "## Limitations\n\n" + limitations(params))


def student_card(summary: dict, params: dict, tasks: dict[str, Task], path: str, distill: dict) -> str:
    """A distilled student's card: a variant's, with what taught it (`distill`: the stage's record of the
    configuration, the blend and each task's teacher members)."""
    members = "\n".join(f"- {name}: " + ", ".join(f"`{m}` ×{n}" for m, n in distill["members"][name].items())
                        for name in tasks)
    notes = ("## Distillation\n\n"
             f"A student of the mtbert ensemble, with the configuration of variant `{distill['variant']}` (seed "
             f"{params['train']['seed']}), trained on the training split with each row's loss blended from the "
             f"ensemble's prediction of it (weight α = {distill['alpha']}; classes at temperature "
             f"T = {distill['temperature']}) and its gold label (1 − α). The teacher's members per task:\n\n"
             f"{members}\n\n")
    transfer = {name: rows for name, rows in distill.get("transfer", {}).items() if rows}
    if transfer:
        notes += ("It also learned the ensemble's predictions of a transfer set of new inputs made of training-split "
                  "text only (no gold label; loss weight " f"{distill['transfer_weight']}): " +
                  ", ".join(f"{name} {rows:,} rows" for name, rows in transfer.items()) + ".\n\n")
    return variant_card(summary, params, tasks, path, title=f"mtbert student `{summary['variant']}`", notes=notes)


def ensemble_card(report: dict, params: dict, tasks: dict[str, Task], path: str, encoders: list[str]) -> str:
    """The ensemble's card, from metrics/ensemble.json's report, the shared params and its members'
    encoders (members may have their own `model.name`)."""
    dev = {name: {metric: value for metric, value in report[name].items()
                  if metric in task.kind.metric_names} for name, task in tasks.items()}
    members = "\n".join(f"- {name}: " + ", ".join(f"`{m}` ×{n}" for m, n in report[name]["members"].items())
                        for name in tasks)
    honest = ", ".join(f"{name} {report[name]['honest']['score']:.4f}" for name in tasks)
    return (metadata("mtbert-ensemble", params, tasks, dev, encoders) +
            f"\n# mtbert ensemble (`{report['method']}`)\n\n"
            f"Per task, the average of the unrounded predictions of its members, chosen on dev among the "
            f"variants {', '.join(f'`{v}`' for v in report['variants'])}:\n\n{members}\n\n"
            "## Dev metrics\n\n" + metrics_table(tasks, dev) +
            f"\nHonest split-half estimate (members chosen on one half of dev, scored on the other): {honest}; "
            f"overall {report['honest_overall']:.4f}.\n\n"
            "## How to use\n\n" + usage(path, tasks, ensemble=True) +
            "\n## Limitations\n\n" + limitations(params, encoders))
