"""A small OpenAI-compatible chat server that behaves as vLLM does where `data regenerate
--server` must not let a server choose (no tests here).

vLLM (its default `--generation-config auto`), and SGLang with `--sampling-defaults model`,
fill every sampling field a request leaves out from the model's generation_config.json:
temperature, top_p, top_k, min_p and repetition_penalty. This server does the same and
decodes with transformers' `generate` in fp32, so a reply is the target's own greedy reply
exactly when the request set every field to its neutral value. Like SGLang (and vLLM before
0.8) it refuses top_k 0 with a 400. `refuse` maps a text found in a request's messages to
the 4xx answered for it; `down` answers every route with 503, as a restarting server does.
It runs in a thread of the test's process (http.server), so nothing is spawned.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

# vLLM's get_diff_sampling_param: the generation_config fields that become request defaults
FILLED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


class VllmLikeServer:
    def __init__(self, target_dir: Path, name: str = "tiny"):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.name, self.root = name, str(Path(target_dir).resolve())
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        config = GenerationConfig.from_pretrained(target_dir).to_dict()
        self.defaults = {key: config[key] if config.get(key) is not None else value for key, value in FILLED.items()}
        self.eos_token_id = config.get("eos_token_id", self.tokenizer.eos_token_id)
        self.refuse: dict[str, tuple[int, str]] = {}
        self.down = False
        self.bodies: list[dict] = []  # every chat request as it came in
        self.lock = threading.Lock()  # one generate at a time
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "VllmLikeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def reply(self, body: dict) -> tuple[int, dict]:
        """A chat completion request -> (HTTP status, JSON answer)."""
        self.bodies.append(json.loads(json.dumps(body)))
        if body.get("model") != self.name:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
        text = json.dumps(body["messages"])
        for needle, (status, message) in self.refuse.items():
            if needle in text:
                return status, {"error": {"message": message}}
        params = {key: body[key] if body.get(key) is not None else self.defaults[key] for key in FILLED}
        if params["top_k"] == 0 or params["top_k"] < -1:
            return 400, {"error": {"message": f"top_k must be -1 (disable), or at least 1, got {params['top_k']}."}}
        if body.get("presence_penalty") or body.get("frequency_penalty"):
            return 400, {"error": {"message": "presence and frequency penalties are not implemented here"}}
        prompt = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False,
                                                    **(body.get("chat_template_kwargs") or {}))
        ids = torch.tensor([self.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        sampled = params["temperature"] > 0
        options = dict(do_sample=sampled, repetition_penalty=params["repetition_penalty"],
                       max_new_tokens=body["max_tokens"], eos_token_id=self.eos_token_id,
                       pad_token_id=self.eos_token_id)
        if sampled:
            options.update(temperature=params["temperature"], top_p=params["top_p"], min_p=params["min_p"] or None,
                           top_k=params["top_k"] if params["top_k"] > 0 else None)
        with self.lock, torch.no_grad():
            if sampled:
                torch.manual_seed(body.get("seed") or 0)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **options)[0, ids.shape[1]:].tolist()
        content = self.tokenizer.decode(out, skip_special_tokens=True)
        return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                  "finish_reason": "stop"}], "usage": {"completion_tokens": len(out)}}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if server.down:
                    return self._answer(503, {"error": {"message": "restarting"}})
                if self.path == "/v1/models":
                    return self._answer(200, {"object": "list", "data": [{"id": server.name, "root": server.root}]})
                self._answer(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.down:
                    return self._answer(503, {"error": {"message": "restarting"}})
                if self.path != "/v1/chat/completions":
                    return self._answer(404, {"error": {"message": f"no route {self.path}"}})
                self._answer(*server.reply(body))

        return Handler
