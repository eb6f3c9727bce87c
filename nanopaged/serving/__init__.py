"""The OpenAI-compatible server (`nanopaged serve`): read in order, args.py (the command
line), server.py (the app: its engine loop and routes), openai_api.py (each request's
fields, honoured or refused by name), openai_responses.py (the answers, streamed or
not), tool_calls.py (tool calls parsed from the text), served_models.py (the base model
and the LoRA adapters a client may name), router.py (data-parallel replicas), cli.py
(the `nanopaged` command)."""
