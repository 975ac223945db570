"""OpenAI-compatible and native HTTP API over the engine (`specserve serve`).

`app.create_app` / `app.run_server` build and run it; `config.ServerConfig` holds its options.
Nothing is imported here so that the CLI can read the server flags without loading FastAPI.
"""
