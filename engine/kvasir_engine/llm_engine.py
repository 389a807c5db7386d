"""`LLMEngine`: tokenizer + `EngineCore` + output processor, driven synchronously.

The offline `generate` command and the HTTP server's async bridge both sit on this class.
(Implementation in progress by the lead; the interface below is the contract.)

    engine = LLMEngine.from_config(config)     # loads the model, builds RuntimeInfo
    engine.tokenizer                           # kvasir_engine.tokenizer.Tokenizer
    engine.runtime                             # RuntimeInfo
    engine.add_request(request_id, prompt_token_ids, params, cache_salt=None, arrival_time=None)
        # ValueError (never fits: message names the numbers), QueueFullError (queue full)
    engine.abort_request(request_ids)
    engine.step() -> list[RequestOutput]        # one scheduler step; deltas of every request that moved
    engine.has_unfinished_requests() -> bool
    engine.last_stats -> SchedulerStats; engine.step_index -> int; engine.last_step_seconds -> float
    engine.generate(prompts: list[list[int]], params: SamplingParams | list[SamplingParams])
        -> list[FinalOutput]                    # all prompts scheduled together
    engine.shutdown()
"""
