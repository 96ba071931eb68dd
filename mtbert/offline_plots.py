"""An HTML template for `dvc plots show` whose page renders without a network: `make plots`.

DVC's own page loads Vega, Vega-Lite and Vega-Embed from a CDN (cdn.jsdelivr.net), so offline it is blank.
This template holds them inline instead, from vl-convert's bundle (the Vega project's own packaging of the
three): `dvc plots show --html-template <it>`. It leaves out DVC's `{scripts}` placeholder, where DVC puts
its CDN tags, and keeps `{plot_divs}`, where DVC puts each plot's `vegaEmbed` call.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mtbert import io
from mtbert.runtime import run_app

VEGA_LITE = "5.21"  # DVC's plot templates are Vega-Lite 5 specifications
app = typer.Typer(add_completion=False)

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot</title>
    <script>(function () {
BUNDLE
})();</script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def offline_template() -> str:
    """DVC's page with Vega, Vega-Lite and Vega-Embed inline (in a function scope: only the `vega`,
    `vegaLite` and `vegaEmbed` it sets on `window` are global, and nothing clashes with DVC's scripts)."""
    import vl_convert

    bundle = vl_convert.javascript_bundle(vl_version=VEGA_LITE)
    if any(placeholder in bundle for placeholder in ("{plot_divs}", "{scripts}", "{refresh_tag}")):
        raise RuntimeError("the Vega bundle holds one of DVC's template placeholders; DVC would fill it in")
    return PAGE.replace("BUNDLE", bundle)


@app.command()
def main(out: Path = typer.Argument(Path(".dvc/tmp/plots-offline.html"), help="the template to write")) -> None:
    io.write_text(out, offline_template())
    print(f"{out}: use it with `dvc plots show --html-template {out}`")


if __name__ == "__main__":
    run_app(app)
