"""Tool calls and reasoning in chat output, as vLLM's `--tool-call-parser` / `--reasoning-parser`
read them (docs/serving.md, "Tool calling and reasoning").

    base.py       ToolCall, ChatDelta; TagSplitter (streamed text → text outside `start…end`
                  blocks and whole blocks: the one place that holds back a partial tag)
    glm.py        GLM-4.5 / 4.7 / 5 calls: <tool_call>NAME<arg_key>k</arg_key><arg_value>v…
    dsml.py       DeepSeek-V3.2 calls: <｜DSML｜function_calls><｜DSML｜invoke name="…">…
    values.py     argument text → JSON values by the tool's parameter schema
    reasoning.py  <think>…</think> → reasoning_content (thinking on or off per request)
    output.py     ChatOutputParser: one request's text deltas → reasoning, content and calls
    registry.py   the parsers by vLLM's names; which parser a request gets (its tool fields,
                  vLLM's rules and 400s)

Every parser is incremental and split-invariant: however the text is cut into deltas, the deltas
it returns join to what the whole text gives (tests/unit/test_tool_parsers.py checks this over
random splits).
"""
