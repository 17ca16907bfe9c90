"""/docs (Swagger UI) and /redoc that work offline. FastAPI's default pages load their JS and CSS from a CDN,
which a machine without internet cannot reach. The `fastapi-offline` package (MIT, ~0.8 MB, needs only
fastapi) ships those files; when it is installed they are served from /docs-static. Without it, /docs is a
plain page that links /openapi.json (the schema itself never needs the network)."""
from __future__ import annotations

import os

from fastapi import Request

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

    def root(request: Request) -> str:           # (behind --root-path the pages' links carry the prefix)
        return request.scope.get("root_path", "").rstrip("/")

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        r = root(request)
        if d is None:
            return HTMLResponse("<!doctype html><title>jaxinfer API</title><h1>jaxinfer API</h1><p>The interactive "
                                "docs need the <code>fastapi-offline</code> package (its JS and CSS are served "
                                f"locally). The API schema: <a href='{r}/openapi.json'>{r}/openapi.json</a>. The "
                                "endpoints and fields: docs/serving.md.</p>")
        return get_swagger_ui_html(openapi_url=r + app.openapi_url, title="jaxinfer API",
                                   swagger_js_url=f"{r}{STATIC}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{r}{STATIC}/swagger-ui.css",
                                   swagger_favicon_url=f"{r}{STATIC}/favicon.png")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        r = root(request)
        if d is None:
            return await docs(request)
        return get_redoc_html(openapi_url=r + app.openapi_url, title="jaxinfer API",
                              redoc_js_url=f"{r}{STATIC}/redoc.standalone.js",
                              redoc_favicon_url=f"{r}{STATIC}/favicon.png", with_google_fonts=False)


def package_version() -> str:
    """jaxinfer's installed version (the OpenAPI schema's and /version's)."""
    import jaxinfer
    return jaxinfer.__version__
