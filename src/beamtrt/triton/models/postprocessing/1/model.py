"""Triton Python-backend model postprocessing: output_ids (after context_ids, cut to text_end) -> text_output."""

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
        tokenizer = load_tokenizer(Path(args["model_repository"]).parent / params["tokenizer_dir"])
        self.decode = protocol.make_decode(tokenizer)

    def execute(self, requests):
        responses = []
        for request in requests:
            values = {t.name: pb_utils.get_input_tensor_by_name(request, t.name).as_numpy()
                      for t in self.protocol.POST_INPUTS}
            try:
                outputs = self.protocol.postprocess(self.decode, values)
            except self.protocol.RequestError as e:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
        return responses
