"""`kvasir-engine`: `serve` (the OpenAI HTTP server) and `generate` (offline, for users and checks).

Entry point only: parse flags, build the frozen config, hand over. Any configuration that cannot
work fails here with one clear line and exit code 2, before a model is loaded or a port opened.
A node with `--node-rank` above 0 runs only its ranks (worker/worker_node.py), whichever command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvasir_engine import __version__
from kvasir_engine.args import add_engine_args, apply_env_defaults, engine_config_from_args
from kvasir_engine.config import EngineConfig
from kvasir_engine.core.request import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvasir-engine")
    parser.add_argument("--version", action="version", version=f"kvasir-engine {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(serve)
    from kvasir_engine.server.config import add_server_args

    add_server_args(serve)

    generate = commands.add_parser("generate", help="generate offline for some prompts")
    add_engine_args(generate)
    generate.add_argument("--prompt", action="append", default=[], help="repeatable")
    generate.add_argument("--prompts-file", type=Path, default=None,
                          help="JSON lines with a 'prompt' string or 'messages' list each")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--stop", action="append", default=[])
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template")
    generate.add_argument("--output", choices=("json", "text"), default="text")
    for sub in (serve, generate):
        apply_env_defaults(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        config = engine_config_from_args(ns)
        if config.parallel.node_rank > 0:  # a worker node: its ranks, no server
            return _worker_node(config)
        if ns.command == "serve":
            from kvasir_engine.server.config import server_config_from_args
            from kvasir_engine.server.launch import run_server

            return run_server(config, server_config_from_args(ns))
        return _generate(config, ns)
    except ValueError as exc:
        print(f"kvasir-engine: error: {exc}", file=sys.stderr)
        return 2


def _worker_node(config: EngineConfig) -> int:
    import logging

    from kvasir_engine.worker.worker_node import run_worker_node

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_worker_node(config)


def _read_prompts(ns: argparse.Namespace) -> list[str | list[dict[str, str]]]:
    prompts: list[str | list[dict[str, str]]] = list(ns.prompt)
    if ns.prompts_file is not None:
        for number, line in enumerate(ns.prompts_file.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{ns.prompts_file}:{number}: not JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or not ({"prompt", "messages"} & record.keys()):
                raise ValueError(f"{ns.prompts_file}:{number}: needs a 'prompt' or 'messages' field")
            prompts.append(record.get("messages") or record["prompt"])
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompts-file")
    for index, prompt in enumerate(prompts):
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise ValueError(f"prompt {index}: is empty")
    return prompts


def _generate(config: EngineConfig, ns: argparse.Namespace) -> int:
    from kvasir_engine.frontend.llm_engine import LLMEngine

    prompts = _read_prompts(ns)
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            max_tokens=ns.max_tokens, ignore_eos=ns.ignore_eos,
                            stop=tuple(ns.stop), seed=ns.seed)
    engine = LLMEngine.from_config(config)
    try:
        token_ids = []
        for index, prompt in enumerate(prompts):
            if ns.chat or not isinstance(prompt, str):
                messages = prompt if not isinstance(prompt, str) else [
                    {"role": "user", "content": prompt}]
                text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                ids = engine.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = engine.tokenizer.encode(prompt)
            limit = config.model.max_model_len
            if len(ids) + ns.max_tokens > limit:
                raise ValueError(f"prompt {index}: {len(ids)} prompt tokens + max_tokens "
                                 f"{ns.max_tokens} exceed --max-model-len {limit}")
            token_ids.append(ids)
        results = engine.generate(token_ids, params)
    finally:
        engine.shutdown()
    if ns.output == "json":
        print(json.dumps([{
            "prompt": prompt if isinstance(prompt, str) else None,
            "messages": None if isinstance(prompt, str) else prompt,
            "prompt_token_ids": r.prompt_token_ids,
            "token_ids": r.token_ids,
            "text": r.text,
            "finish_reason": r.finish_reason,
            "num_cached_tokens": r.num_cached_tokens,
        } for prompt, r in zip(prompts, results, strict=True)], indent=2))
    else:
        for r in results:
            print(f"--- {r.request_id} ({r.finish_reason}) ---\n{r.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
