"""The public API over the step loop: the gRPC Generate and OrchestratorAdmin servicers, the OpenAI-compatible HTTP API
(its protocol, chat templates, logprobs) with tool-call formats, grammars and streaming, and the tokenizer."""
