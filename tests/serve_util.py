"""A real server on a free local port, for the server tests and the fault suite."""
import socket
import threading
import time

import httpx
import openai
import uvicorn

from fuzzyspec.api import ModelPair
from fuzzyspec.serve.app import ServeConfig, Server, create_app


class Running:
    def __init__(self, tiny_dirs, draft=None, **options):
        self.pair = ModelPair.load(tiny_dirs["target"], draft or tiny_dirs["draft"], "float32")
        config = ServeConfig(**{"model_name": "tiny", "defaults": {"temperature": 0.0, "max_new_tokens": 16},
                                **options})
        self.server = Server(self.pair, config)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(create_app(self.server), host="127.0.0.1", port=port,
                                                     log_level="error"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)

    def slow_down(self, seconds):
        """Make every decoding step take at least ``seconds`` (to fill queues and run out of time)."""
        scheduler = self.server.scheduler
        step = scheduler.engine.step

        def slow():
            time.sleep(seconds)
            return step()
        scheduler.engine.step = slow

    def metric(self, name):
        text = httpx.get(self.url + "/metrics").text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line.startswith("fuzzyspec_" + name)}
