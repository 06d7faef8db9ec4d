"""``popjax generate``: text from one or more prompts, with an optional pruning method."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import distributed
from ..convert.sources import refuse_images
from ..generation import generate, stream
from ..loading import load
from .common import add_distributed_args, add_method_args, add_model_arg, add_weights_arg, mesh_from_args, method_from_args


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate text with an optional pruning method")
    gen.add_argument("prompts", nargs="+", help="one or more prompts (batched together)")
    add_model_arg(gen)
    gen.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU/TPU, float32 on CPU)")
    add_weights_arg(gen)
    gen.add_argument("--scan-layers", action="store_true", help="run the layers under lax.scan: faster compiles, slower CPU decode (docs/performance.md)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image for a vision-language model (repeatable): given before the text of every prompt")
    add_method_args(gen)
    add_distributed_args(gen)
    gen.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    method = method_from_args(args)  # validate before the (slow) load
    if args.image:
        if args.no_chat:
            raise SystemExit("popjax generate: --image needs the chat template (it writes the image placeholders); drop --no-chat")
        refuse_images(args.model)  # a named source without a vision tower: one line before loading it
        missing = [path for path in args.image if not Path(path).is_file()]
        if missing:
            raise FileNotFoundError(f"--image {missing[0]}: no such file")
    model = load(args.model, dtype=args.dtype, scan_layers=args.scan_layers, weights=args.weights, mesh=mesh_from_args(args))
    show = distributed.is_main()  # every process generates the same tokens; process 0 prints them
    prompts = list(args.prompts)
    if args.image:  # a chat message whose content is the images, then the text (transformers' format)
        images = [{"type": "image", "image": path} for path in args.image]
        prompts = [[{"role": "user", "content": [*images, {"type": "text", "text": text}]}] for text in prompts]
    options = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        method=method,
        chat=False if args.no_chat else None,
    )
    if len(prompts) == 1:  # one prompt: print its tokens as they come
        for piece in stream(model, prompts[0], **options):
            if show:
                print(piece.text, end="", flush=True)
        if show:
            print()
        return
    out = generate(model, prompts, **options)
    if not show:
        return
    for prompt, text in zip(args.prompts, out.texts):
        print(f"### {prompt}")
        print(text)
