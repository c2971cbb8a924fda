"""The openai client's `chat.completions.parse` with a Pydantic model, N prompts, against a
random-weight model: every answer must parse into a valid object (the grammar makes it so).

Starts `python -m orca_ext serve` on 127.0.0.1 with a tiny random Qwen3-shaped model (built in a
temporary folder with the default model's tokenizer, tests/tool_models.py), sends `--prompts`
requests from `--concurrency` threads (temperature 1, one seed each), and counts valid objects.

    python bench/guided_parse.py [--prompts 100] [--concurrency 8]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Annotated
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import openai  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)
    email: str = Field(pattern=r"^[a-z]{1,8}@[a-z]{1,8}\.(com|org)$")
    member: bool
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=300)
    args = ap.parse_args(argv)

    from http_utils import ServerProcess
    from orca_ext.default_model import default_model_path
    from tool_models import make_tool_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tool_model(tmp, default_model_path())
        with ServerProcess("--model", str(model), "--n-slots", "16384") as sp:
            client = openai.OpenAI(base_url=sp.url("/v1"), api_key="none", max_retries=0, timeout=600)
            name = client.models.list().data[0].id

            def one(i: int):
                try:
                    done = client.chat.completions.parse(
                        model=name, messages=[{"role": "user", "content": f"Invent person number {i}."}],
                        response_format=Person, max_tokens=args.max_tokens, temperature=1.0, seed=i)
                except openai.LengthFinishReasonError as exc:  # cut by max_tokens: not a valid object
                    return False, "length", exc.completion.usage.completion_tokens
                c = done.choices[0]
                ok = (isinstance(c.message.parsed, Person)
                      and Person.model_validate_json(c.message.content) == c.message.parsed)
                return ok, c.finish_reason, done.usage.completion_tokens

            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(one, range(args.prompts)))
            wall = time.perf_counter() - start
    valid = sum(ok for ok, _, _ in results)
    reasons = {r: sum(1 for _, x, _ in results if x == r) for r in {x for _, x, _ in results}}
    tokens = sum(t for _, _, t in results)
    print(f"{valid} of {args.prompts} parsed into a valid Person; finish reasons {reasons}; "
          f"{tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s, concurrency {args.concurrency})")
    return 0 if valid == args.prompts else 1


if __name__ == "__main__":
    raise SystemExit(main())
