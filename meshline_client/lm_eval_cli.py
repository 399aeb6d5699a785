"""`python -m meshline_client.lm_eval_cli <lm-eval args>`: lm-eval's CLI with `--model meshline`.

lm-eval 0.4 discovers models only through its registry, so this imports
`meshline_client.lm_eval_model` (which registers `meshline`) and then runs lm-eval's own
command line unchanged.
"""

from __future__ import annotations

import meshline_client.lm_eval_model  # noqa: F401  (registers --model meshline)


def main() -> None:
    """lm-eval's CLI entry point, with the meshline model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
