"""`minillm distill`: distil a student for a task and print it beside its teacher; `minillm distill export`: to GGUF.

    minillm distill --task extract --layers 6 --out students/extract-6 [--compare] [--plot loss.html]
    minillm distill export students/extract-6 --type q8_0 --out exports/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _in_range(name: str, low, high, kind=int):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not a number ({low}..{high})") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{name} {value} is outside {low}..{high}")
        return value
    return parse


def cmd_distill(args) -> int:
    from ..distill.pipeline import DistillRecipe, distill

    recipe = DistillRecipe(task=args.task, teacher=args.teacher, adapter=args.adapter, num_layers=args.layers,
                           layer_strategy=args.strategy, intermediate_size=args.intermediate_size,
                           num_train=args.train, num_heldout=args.heldout, steps=args.steps,
                           batch_size=args.batch_size, lr=args.lr, temperature=args.temperature, alpha=args.alpha,
                           seed=args.seed)
    result = distill(recipe, args.out, compare=args.compare, progress=not args.no_progress)
    print(f"task {recipe.task}: student keeps layers {result.keep_layers}, saved to {result.path}")
    print(result.report)
    print("phases: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in result.seconds.items()))
    print(f"load it: LLM({str(result.path)!r}) or AutoModelForCausalLM.from_pretrained({str(result.path)!r}); "
          f"export it: minillm distill export {result.path} --type q8_0")
    if args.plot:
        result.loss_figure().write_html(args.plot)
        print(f"loss curve: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recipe": dataclasses.asdict(recipe), "rows": result.rows, "seconds": result.seconds,
                       "histories": result.histories}, f, indent=1)
    return 0


def cmd_export(argv: list[str]) -> int:
    from ..distill.export_gguf import FILE_TYPES, export_gguf

    parser = argparse.ArgumentParser(prog="minillm distill export",
                                     description="a Hugging Face Llama directory to GGUF, with an Ollama Modelfile")
    parser.add_argument("model", help="an HF directory (a distilled student, or 'default' for SmolLM2-135M-Instruct)")
    parser.add_argument("--type", dest="file_type", choices=list(FILE_TYPES), default="q8_0")
    parser.add_argument("--out", default="exports", help="the folder for the .gguf and the Modelfile")
    parser.add_argument("--name", default=None, help="the file's stem (default: the directory's name)")
    args = parser.parse_args(argv)
    model = args.model
    if model == "default":
        from ..models.default import default_model_path

        model = default_model_path()
    try:
        path = export_gguf(model, args.out, args.file_type, args.name)
    except (ValueError, FileNotFoundError, NotImplementedError) as exc:
        print(f"minillm distill export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) and {path.parent / 'Modelfile'}")
    print(f"llama.cpp: llama-cli -m {path}; Ollama: cd {path.parent} && ollama create my-model -f Modelfile")
    return 0


def add_parser(sub) -> None:
    from ..distill.pipeline import DistillRecipe
    from ..distill.student import STRATEGIES
    from ..distill.tasks import TASKS

    r = DistillRecipe()     # the defaults live in the recipe

    d = sub.add_parser("distill", help="distil a smaller student from a teacher on a focused task and score it "
                                       "beside the teacher on held-out messages (export: minillm distill export)")
    d.add_argument("--task", choices=list(TASKS), default=r.task,
                   help="extract: name / order id / product as JSON; intent: one of the support intents as JSON")
    d.add_argument("--teacher", default=None, help="an HF directory (default: SmolLM2-135M-Instruct)")
    d.add_argument("--adapter", default=None, help="a PEFT adapter directory merged into the teacher")
    d.add_argument("--layers", type=_in_range("--layers", 1, 1000), default=r.num_layers,
                   help="layers the student keeps")
    d.add_argument("--strategy", choices=list(STRATEGIES), default=r.layer_strategy, help="which layers it keeps")
    d.add_argument("--intermediate-size", type=_in_range("--intermediate-size", 1, 1 << 20), default=None,
                   help="narrower MLPs (default: the teacher's width)")
    d.add_argument("--train", type=_in_range("--train", 1, 5000), default=r.num_train, help="training messages")
    d.add_argument("--heldout", type=_in_range("--heldout", 1, 5000), default=r.num_heldout,
                   help="held-out messages")
    d.add_argument("--steps", type=_in_range("--steps", 1, 100_000), default=r.steps)
    d.add_argument("--batch-size", type=_in_range("--batch-size", 1, 5000), default=r.batch_size)
    d.add_argument("--lr", type=_in_range("--lr", 1e-7, 1.0, float), default=r.lr)
    d.add_argument("--temperature", type=_in_range("--temperature", 0.05, 100.0, float), default=r.temperature)
    d.add_argument("--alpha", type=_in_range("--alpha", 0.0, 1.0, float), default=r.alpha,
                   help="weight of the KL to the teacher (1: KL only, 0: cross-entropy on its tokens only)")
    d.add_argument("--seed", type=int, default=r.seed)
    d.add_argument("--out", default="students/student", help="the student's HF directory")
    d.add_argument("--compare", action="store_true",
                   help="also score the pruned student untrained and one trained on the task's true labels alone")
    d.add_argument("--plot", default=None, metavar="HTML", help="write the plotly loss curve here")
    d.add_argument("--json", default=None, help="also write the scores and loss histories to this file")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_distill)


def _dtypes(text: str) -> tuple[str, ...]:
    from ..distill.sweep import DTYPES

    chosen = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in chosen if t not in DTYPES]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"--dtypes {text!r}: each must be one of {list(DTYPES)}")
    return chosen


def _depths(text: str) -> list[int]:
    try:
        depths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--depths {text!r} is not a comma-separated list of layer counts") from None
    if not depths or any(not 1 <= d <= 1000 for d in depths) or len(set(depths)) != len(depths):
        raise argparse.ArgumentTypeError(f"--depths {text!r}: distinct layer counts in 1..1000")
    return depths


def _teacher_path(teacher: str | None) -> str:
    if teacher is None or teacher == "default":
        from ..models.default import default_model_path

        return str(default_model_path())
    return teacher


def cmd_sweep(argv: list[str]) -> int:
    """minillm distill sweep: students x weight_dtype beside the teacher, the Pareto front, the pick."""
    from ..distill import sweep

    p = argparse.ArgumentParser(prog="minillm distill sweep", description="the smallest model that meets the bar: "
                                "student depth x weight_dtype beside the teacher (score, tok/s, TTFT, memory, $/Mtok)")
    p.add_argument("--students", nargs="*", default=[], help="student HF directories (from minillm distill)")
    p.add_argument("--depths", type=_depths, default=None,
                   help="distil one student per depth first (e.g. 4,6,8) with the default recipe into --out-root")
    p.add_argument("--out-root", default="students/sweep", help="where --depths writes its students")
    p.add_argument("--teacher", default=None, help="the teacher's HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--task", choices=["extract", "intent"], default="extract")
    p.add_argument("--dtypes", type=_dtypes, default=sweep.DTYPES, help="comma-separated: fp32,int8,int4")
    p.add_argument("--margin", type=_in_range("--margin", 0.0, 1.0, float), default=0.05,
                   help="the bar: the teacher's score minus this (0.05 = 5 points)")
    p.add_argument("--heldout", type=_in_range("--heldout", 1, 5000), default=32)
    p.add_argument("--context", type=_in_range("--context", 1, 1 << 20), default=2048,
                   help="tokens of KV cache counted in the resident memory")
    p.add_argument("--tokens", type=_in_range("--tokens", 2, 4096), default=32, help="decode tokens per timed request")
    p.add_argument("--warmup", type=_in_range("--warmup", 0, 100), default=1)
    p.add_argument("--repeats", type=_in_range("--repeats", 1, 100), default=3)
    p.add_argument("--hourly-usd", type=_in_range("--hourly-usd", 0.0, 1e4, float), default=None,
                   help="the device's price per hour (default: minillm's for this device)")
    p.add_argument("--draft", action="store_true", help="also the smallest student as the teacher's draft model "
                   "beside the self-draft and n-gram proposers")
    p.add_argument("--memory", action="store_true", help="also the memory budget against 4 / 8 / 16 GB devices "
                   "and this machine")
    p.add_argument("--llama-cpp", action="store_true", help="also llama.cpp on the pick's GGUF (if installed)")
    p.add_argument("--plot", default=None, metavar="HTML", help="write the plotly Pareto figure here")
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not args.students and not args.depths:
        p.error("give --students DIR [DIR ...] or --depths 4,6,8 (distil them first)")
    teacher = _teacher_path(args.teacher)
    students = {}
    if args.depths:
        from ..distill.pipeline import DistillRecipe, distill_depths

        recipe = DistillRecipe(task=args.task, teacher=teacher)
        for depth, result in distill_depths(recipe, args.depths, args.out_root, not args.no_progress).items():
            students[f"student {depth}"] = result.path
    for path in args.students:
        students[f"student {_student_layers(path)}"] = path
    points = sweep.run_sweep({"teacher": teacher, **students}, args.task, args.heldout, args.dtypes,
                             context=args.context, decode_tokens=args.tokens, warmup=args.warmup,
                             repeats=args.repeats, hourly_usd=args.hourly_usd, progress=not args.no_progress)
    ref = sweep.reference_point(points)
    front = sweep.pareto_front(points)
    pick = sweep.pick_point([p for p in points if p is not ref], ref.score, args.margin)
    print(sweep.format_sweep(points, front, pick, args.margin, args.context, args.task))
    out = {"points": sweep.sweep_rows(points), "pick": pick.name if pick else None, "margin": args.margin}
    if args.plot:
        sweep.sweep_figure(points, front, pick, args.margin).write_html(args.plot)
        print(f"Pareto figure: {args.plot}")
    if args.memory:
        from ..distill import memory

        models = [memory.ModelMemory(p.name, p.weight_bytes, p.kv_bytes // args.context) for p in points]
        device_list = memory.devices()
        rows = memory.memory_table(models, device_list, args.context)
        print(memory.format_memory_table(rows, device_list, args.context))
        out["memory"] = rows
    if args.draft:
        from ..distill.ondevice import draft_comparison, format_draft_table

        smallest = min(students.items(), key=lambda kv: _student_layers(kv[1]))
        result = draft_comparison(teacher, smallest[1], args.task)
        print(f"draft: {smallest[0]} ({smallest[1]})")
        print(format_draft_table(result))
        out["draft"] = result["rows"]
    if args.llama_cpp:
        from ..distill.ondevice import format_llama_cpp, llama_cpp_side_by_side

        chosen = pick if pick is not None and not pick.is_teacher else None
        path = students[chosen.model] if chosen else next(iter(students.values()))
        row = llama_cpp_side_by_side(path, {"fp32": "f16", "int8": "q8_0", "int4": "q4_0"}[
            chosen.weight_dtype if chosen else "fp32"], task=args.task)
        print(format_llama_cpp(row))
        out["llama_cpp"] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


def _student_layers(path) -> int:
    from pathlib import Path

    config = Path(path) / "config.json"
    if not config.is_file():
        raise SystemExit(f"minillm distill sweep: {str(path)!r} is not a Hugging Face directory (no config.json)")
    return json.loads(config.read_text())["num_hidden_layers"]


def cmd_memory(argv: list[str]) -> int:
    """minillm distill memory: weights + KV at a context against 4 / 8 / 16 GB devices and this machine."""
    from ..distill import memory
    from ..llm import LLM

    p = argparse.ArgumentParser(prog="minillm distill memory", description="the memory budget: weights + KV cache "
                                "at a context per model x weight_dtype against devices' RAM, and the bandwidth "
                                "bound on tokens/s on each")
    p.add_argument("models", nargs="*", help="HF directories (students); the teacher is always included")
    p.add_argument("--teacher", default=None, help="the teacher's HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtypes", type=_dtypes, default=("fp32", "int8", "int4"))
    p.add_argument("--context", type=_in_range("--context", 1, 1 << 20), default=2048)
    p.add_argument("--bandwidth-gbs", type=_in_range("--bandwidth-gbs", 0.01, 1e5, float), default=None,
                   help="this machine's bandwidth in GB/s (default: measured)")
    args = p.parse_args(argv)
    models = []
    for name, path in [("teacher", _teacher_path(args.teacher))] + [(f"student {_student_layers(m)}", m)
                                                                      for m in args.models]:
        base = LLM(str(path))
        for dtype in args.dtypes:
            llm = base if dtype == "fp32" else base.with_levers(weight_dtype=dtype)
            models.append(memory.model_memory(llm, f"{name} {dtype}"))
    device_list = memory.devices(None if args.bandwidth_gbs is None else args.bandwidth_gbs * 1e9)
    print(memory.format_memory_table(memory.memory_table(models, device_list, args.context), device_list,
                                     args.context))
    return 0


def cmd_llama_cpp(argv: list[str]) -> int:
    """minillm distill llama-cpp: llama.cpp beside minillm on a model's exported GGUF."""
    from ..distill.ondevice import format_llama_cpp, llama_cpp_side_by_side

    p = argparse.ArgumentParser(prog="minillm distill llama-cpp", description="export a model to GGUF and run it "
                                "through llama.cpp (llama-cpp-python) beside minillm: tok/s and greedy tokens")
    p.add_argument("model", help="an HF directory (a student, or 'default')")
    p.add_argument("--type", dest="file_type", choices=["f16", "q8_0", "q4_0"], default="f16")
    p.add_argument("--gguf", default=None, help="an exported GGUF of the same model (default: export it now)")
    p.add_argument("--task", choices=["extract", "intent"], default="extract")
    p.add_argument("--tokens", type=_in_range("--tokens", 2, 4096), default=32)
    p.add_argument("--repeats", type=_in_range("--repeats", 1, 100), default=3)
    args = p.parse_args(argv)
    model = _teacher_path(None) if args.model == "default" else args.model
    print(format_llama_cpp(llama_cpp_side_by_side(model, args.file_type, args.gguf, args.task, args.tokens,
                                                  repeats=args.repeats)))
    return 0
