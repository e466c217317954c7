"""A newcomer's first answer (issue 49): the README's example lines, which set no sampling field,
answer the embedded model's question right through /chat and the OpenAI route alike (one set of
defaults: the model's, then rill's; the page's API: tests/test_gradio_client.py)."""

from __future__ import annotations

import httpx

from tests.servers import SSEReader, chat_text

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


def test_the_readme_lines_answer_the_question_at_the_defaults(embedded_server):
    url = embedded_server.url
    for _ in range(3):  # the README's curl line, as is
        with httpx.stream("POST", f"{url}/chat", json={"prompt": QUESTION, "stream": True}, timeout=120) as response:
            assert response.status_code == 200
            assert chat_text(list(SSEReader(response))) == ANSWER
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": QUESTION}]}).json()
    assert chat["choices"][0]["message"]["content"] == ANSWER
