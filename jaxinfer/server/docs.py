"""/docs (Swagger UI) and /redoc that work offline. FastAPI's default pages load their JS and CSS from a CDN,
which a machine without internet cannot reach. The `fastapi-offline` package (MIT, ~0.8 MB, needs only
fastapi) ships those files; when it is installed they are served from /docs-static. Without it, /docs is a
plain page that links /openapi.json (the schema itself never needs the network)."""
from __future__ import annotations

import os

STATIC = "/docs-static"


def assets_dir() -> str | None:
    try:
        import fastapi_offline
    except ImportError:
        return None
    d = os.path.join(os.path.dirname(fastapi_offline.__file__), "static")
    return d if os.path.isfile(os.path.join(d, "swagger-ui-bundle.js")) else None


def add_docs(app, off: bool = False) -> None:
    """/docs and /redoc (off: none, --disable-fastapi-docs)."""
    if off:
        return
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.responses import HTMLResponse
    d = assets_dir()
    if d is not None:
        from starlette.staticfiles import StaticFiles
        app.mount(STATIC, StaticFiles(directory=d), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        if d is None:
            return HTMLResponse("<!doctype html><title>jaxinfer API</title><h1>jaxinfer API</h1><p>The interactive "
                                "docs need the <code>fastapi-offline</code> package (its JS and CSS are served "
                                "locally). The API schema: <a href='/openapi.json'>/openapi.json</a>. The "
                                "endpoints and fields: docs/serving.md.</p>")
        return get_swagger_ui_html(openapi_url=app.openapi_url, title="jaxinfer API",
                                   swagger_js_url=f"{STATIC}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{STATIC}/swagger-ui.css",
                                   swagger_favicon_url=f"{STATIC}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc():
        if d is None:
            return await docs()
        return get_redoc_html(openapi_url=app.openapi_url, title="jaxinfer API",
                              redoc_js_url=f"{STATIC}/redoc.standalone.js", redoc_favicon_url=f"{STATIC}/favicon.png",
                              with_google_fonts=False)


def package_version() -> str:
    """jaxinfer's installed version (the OpenAPI schema's and /version's)."""
    try:
        from importlib.metadata import version
        return version("jaxinfer")
    except Exception:
        return "0+unknown"
