"""The front end: everything between a caller and `EngineCore` that is not HTTP.

`LLMEngine` (tokenizer + core + output processor, driven synchronously; the offline `generate`
and the Python API use it directly), the output processor and detokenizer (token ids -> text
deltas, stop strings), `RequestOutput` (what callers receive) and `EngineThread`, the bridge that
drives `LLMEngine.step()` from its own thread for an asyncio caller and routes each output to
the `RequestGroup` that asked for it. The HTTP server (`server/`) sits on top; nothing here
imports it.
"""
