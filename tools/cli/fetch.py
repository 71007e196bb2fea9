"""`llama32 fetch`: download the default model (SmolLM2-135M-Instruct GGUF) ahead of time and print its path."""
from __future__ import annotations

import click

from tools.default_model import cache_dir, default_model_path, fetch as fetch_model, size_text


@click.command(help=f"Download the default model (SmolLM2-135M-Instruct, a {size_text()} GGUF) into $LLAMA32_CACHE "
                    f"(default ~/.cache/llama32) and print its path.")
@click.option("--force", is_flag=True, help="Download again even if the model is already cached.")
def fetch(force):
    path = fetch_model(cache_dir()) if force else default_model_path(fetch_if_missing=True)
    click.echo(str(path))
