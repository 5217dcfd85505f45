"""Triton Python-backend model postprocessing: output_ids (after context_ids, cut to text_end) -> text_output."""

import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        sys.path.insert(0, params["python_path"])  # the folder holding the beamtrt package
        from beamtrt.prompts import load_tokenizer, make_decode
        from beamtrt.triton import protocol

        self.protocol = protocol
        tokenizer = load_tokenizer(Path(args["model_repository"]).parent / params["tokenizer_dir"])
        self.decode = make_decode(tokenizer)

    def execute(self, requests):
        return self.protocol.respond(pb_utils, requests, self.protocol.POST_INPUTS,
                                     lambda values: self.protocol.postprocess(self.decode, values))
