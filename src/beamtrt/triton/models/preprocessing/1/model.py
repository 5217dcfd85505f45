"""Triton Python-backend model preprocessing: text_input -> input_ids through the target's chat template."""

import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        sys.path.insert(0, params["python_path"])  # the folder holding the beamtrt package
        from beamtrt.prompts import load_tokenizer
        from beamtrt.triton import protocol

        self.protocol = protocol
        self.tokenizer = load_tokenizer(Path(args["model_repository"]).parent / params["tokenizer_dir"])
        self.chat_template = params["chat_template"] == "true"

    def execute(self, requests):
        def step(values):
            return self.protocol.preprocess(self.tokenizer, values, self.chat_template)
        return self.protocol.respond(pb_utils, requests, self.protocol.PRE_INPUTS, step)
