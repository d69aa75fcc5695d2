"""The chat template and tool schema of the --agent-function-path tests (tests/rollout/test_agent_endpoint.py,
tests/e2e/test_openai_agent_e2e.py): a char-tokenizer template that renders tools and assistant tool calls."""

# renders tools (their names), assistant tool calls (Hermes form, arguments | tojson, as Qwen2.5's) and ends every
# assistant turn with <eos>, the token the model stops on: an append-only template
TEMPLATE = ("{% if tools %}<|system|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] %}{{ m['content'] }}{% endif %}"
            "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}"
            "\", \"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}"
            "{% if m['role'] == 'assistant' %}<eos>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "integer arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
