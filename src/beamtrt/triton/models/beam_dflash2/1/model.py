"""Triton Python-backend model beam_dflash2 (decoupled): adapts Triton requests to beamtrt.triton.serving.

Leader mode: scripts/launch_triton.sh starts one tritonserver per rank under mpirun; each runs this file in a Python
backend stub process, which inherits the rank's MPI environment and joins MPI COMM_WORLD when beamtrt opens the
build. Rank 0 loads its shard and serves requests (beamtrt.triton.serving.Server); every other rank loads its shard
and replays rank 0's backend calls in a thread (serving.Follower) and never receives requests.
"""

import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        sys.path.insert(0, params["python_path"])  # the folder holding the beamtrt package
        from beamtrt.triton import protocol, serving

        self.protocol = protocol
        repository = Path(args["model_repository"]).parent  # args give this model's folder
        self.server = serving.open_server(serving.ServeSettings.from_parameters(params, repository))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            values = {t.name: tensor.as_numpy() for t in self.protocol.FIELDS
                      if (tensor := pb_utils.get_input_tensor_by_name(request, t.name)) is not None}
            try:
                self.server.submit(values, lambda delta, sender=sender: self._send(sender, delta), sender.is_cancelled)
            except Exception as e:  # a bad field (INVALID_ARG, one line), a closed server, or a failure
                code = (pb_utils.TritonError.INVALID_ARG if isinstance(e, self.protocol.RequestError) else
                        pb_utils.TritonError.UNAVAILABLE if isinstance(e, self.protocol.ServerClosed) else None)
                error = pb_utils.TritonError(str(e) if code is not None else f"{type(e).__name__}: {e}",
                                             pb_utils.TritonError.INTERNAL if code is None else code)
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _send(self, sender, delta):
        """Called from the decode thread with each delta; the last one closes the response stream."""
        if delta.finish_reason == "cancelled":
            response = pb_utils.InferenceResponse(
                error=pb_utils.TritonError("the request was cancelled", pb_utils.TritonError.CANCELLED))
        elif delta.error:  # the server shutting down (a client may retry elsewhere), or a failure in the decoder
            code = pb_utils.TritonError.UNAVAILABLE if delta.unavailable else pb_utils.TritonError.INTERNAL
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(delta.error, code))
        else:
            outputs = self.protocol.delta_outputs(delta)
            response = pb_utils.InferenceResponse([pb_utils.Tensor(name, value) for name, value in outputs.items()])
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if delta.finished else 0)

    def finalize(self):
        self.server.close()
