"""The live server: an OpenAI-compatible endpoint over the engine, a live trace stream and a page.

Importing this package imports nothing heavy; use `workbench.server.app.create_app(engine)` for the
app and `workbench serve` (workbench.server.cli_args) to run it.
"""
