"""OpenAI-compatible HTTP serving over orca_ext.Server (FastAPI + uvicorn).

`create_app(server, model_name=..., max_queue=..., api_key=...)` builds the app;
`python -m orca_ext serve` (serve.add_arguments / serve.main) runs it. Imports are lazy so
that `import orca_ext.http` does not pull in FastAPI for users of the Python API only.
"""
from __future__ import annotations

__all__ = ["create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module 'orca_ext.http' has no attribute {name!r}")
