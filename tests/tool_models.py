"""A tiny random Qwen3-shaped model whose chat template renders tools, Qwen2.5 / Hermes style.

The template follows Qwen's: the tools go into the system turn inside <tools></tools> with the
instruction to answer in <tool_call></tool_call> blocks; an assistant turn's tool_calls are
rendered as such blocks; tool results are user-side <tool_response> blocks.
"""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from http_utils import ServerProcess

QWEN_TOOLS_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def make_tool_model(directory: str | Path, tokenizer_dir: str | Path) -> Path:
    """A tiny random qwen3 model in `directory` whose chat template takes tools."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(directory, "qwen3", tokenizer_dir=tokenizer_dir)
    (Path(path) / "chat_template.jinja").write_text(QWEN_TOOLS_TEMPLATE)
    return Path(path)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, tokenizer_dir):
    """`python -m orca_ext serve` on the tool model, for one test module (import the fixture)."""
    model = make_tool_model(tmp_path_factory.mktemp("tool_model"), tokenizer_dir)
    with ServerProcess("--model", str(model), "--n-slots", "4096") as sp:
        yield sp


@pytest.fixture(scope="module")
def tool_client(tool_server):
    """The openai client of tool_server."""
    return openai.OpenAI(base_url=tool_server.url("/v1"), api_key="none", max_retries=0, timeout=300)
