"""A small synchronous client for the vlmgraph gRPC API (proto/vlmgraph/v1/service.proto).

    from vlmgraph_client import VlmGraphClient
    with VlmGraphClient("127.0.0.1:50051") as c:
        info = c.model_info()
        for kind, value in c.generate([5, 6, 7], max_new_tokens=8):
            print(kind, value)        # ("tokens", [12]), ..., ("summary", GenerateSummary)
        print(c.forward([5, 6, 7], target_ids=[6, 7, -100]).loss)
        # A model with a tokenizer takes text and chat messages and streams text:
        text, summary = c.chat([{"role": "user", "content": "What is the capital of France?"}],
                               max_new_tokens=32)
        text, summary = c.chat([{"role": "user", "content": [open("cat.png", "rb").read(),
                                                              "What is in this picture?"]}])

Errors are grpc.RpcError (`.code()`, `.details()`), as the server returns them.
"""
import collections
import os

import grpc

from . import protos


def encoded_image(data):
    """An Image message from PNG/JPEG bytes."""
    pb = protos.load()
    return pb.image_pb2.Image(encoded=data)


def tensor_image(shape, values):
    """An Image message from raw float pixels in [0, 1]: shape [3, H, W] or [N, 3, S, S]."""
    pb = protos.load()
    return pb.image_pb2.Image(tensor=pb.image_pb2.FloatTensor(shape=list(shape), values=list(values)))


def _as_images(images):
    out = []
    for img in images or []:
        if isinstance(img, (bytes, bytearray)):
            out.append(encoded_image(bytes(img)))
        else:
            out.append(img)  # already an Image message
    return out


def chat_messages(messages):
    """ChatMessage protos from dicts {"role": ..., "content": str | [str | bytes | Image, ...]}:
    strings are text parts, bytes (PNG/JPEG) and Image messages are image parts."""
    pb = protos.load()
    out = []
    for m in messages:
        content = m["content"]
        parts = []
        for part in [content] if isinstance(content, str) else content:
            if isinstance(part, str):
                parts.append(pb.chat_pb2.ContentPart(text=part))
            else:
                parts.append(pb.chat_pb2.ContentPart(image=_as_images([part])[0]))
        out.append(pb.chat_pb2.ChatMessage(role=m["role"], content=parts))
    return out


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call (docs/security.md)."""

    def __init__(self, key):
        self.header = ("authorization", f"Bearer {key}")

    def _with_key(self, details):
        metadata = list(details.metadata or []) + [self.header]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_key(details), request_iterator)


class _Details(collections.namedtuple("_Details", ["method", "timeout", "metadata", "credentials",
                                                    "wait_for_ready", "compression"]),
               grpc.ClientCallDetails):
    pass


class VlmGraphClient:
    def __init__(self, address, timeout=None, max_message_bytes=256 << 20, api_key=None, root_certificates=None,
                 private_key=None, certificate_chain=None):
        """`api_key` (default: $VLMGRAPH_API_KEY) is sent as `authorization: Bearer KEY`.
        `root_certificates` (PEM bytes) turns TLS on; `private_key` + `certificate_chain` (PEM bytes)
        authenticate the client to a server that requires client certificates."""
        self.pb = protos.load()
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        api_key = os.environ.get("VLMGRAPH_API_KEY") if api_key is None else api_key
        channel = grpc.intercept_channel(self.channel, _BearerKey(api_key)) if api_key else self.channel
        self.stub = self.pb.service_pb2_grpc.VlmGraphStub(channel)
        self.timeout = timeout

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout=30):
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def model_info(self):
        return self.stub.GetModelInfo(self.pb.model_info_pb2.GetModelInfoRequest(), timeout=self.timeout)

    def generate_request(self, input_ids=(), images=None, max_new_tokens=None, sample=False, temperature=None,
                         top_k=0, top_p=None, seed=0, stop_token_ids=(), request_id="", text="", messages=None,
                         stop=(), ignore_eos=False, add_generation_prompt=None, logprobs=False, top_logprobs=0,
                         prompt_logprobs=False, prompt_top_logprobs=0):
        """A GenerateRequest: a prompt of `input_ids`, `text` or chat `messages` (chat_messages()).
        `logprobs` / `top_logprobs` (0-20): each new token's log-probability and the most likely
        tokens there; `prompt_logprobs` / `prompt_top_logprobs`: the same for the prompt's tokens
        from the second on (LogprobsParams in generate.proto)."""
        g = self.pb.generate_pb2
        sampling = g.SamplingParams(sample=sample, top_k=top_k, seed=seed, stop_token_ids=list(stop_token_ids),
                                    stop=list(stop), ignore_eos=ignore_eos)
        if max_new_tokens is not None:
            sampling.max_new_tokens = max_new_tokens
        if temperature is not None:
            sampling.temperature = temperature
        if top_p is not None:
            sampling.top_p = top_p
        req = g.GenerateRequest(input_ids=list(input_ids), images=_as_images(images), sampling=sampling,
                                request_id=request_id, text=text, messages=chat_messages(messages or []))
        if add_generation_prompt is not None:
            req.add_generation_prompt = add_generation_prompt
        req.logprobs.tokens = bool(logprobs)
        req.logprobs.top = top_logprobs
        req.logprobs.prompt = bool(prompt_logprobs)
        req.logprobs.prompt_top = prompt_top_logprobs
        return req

    def generate_stream(self, request, timeout=None):
        """The raw response stream (a grpc call object: iterate it, or .cancel() it)."""
        return self.stub.Generate(request, timeout=timeout or self.timeout)

    def generate(self, input_ids=(), images=None, timeout=None, **sampling):
        """Yields ("tokens", [ids]) as they stream, then ("summary", GenerateSummary). With text=...
        or messages=... (and a model with a tokenizer) it yields ("text", str) after each chunk's
        tokens too; with logprobs=True ("logprobs", [TokenLogprob]) after them, one per token, and
        with prompt_logprobs=True ("prompt_logprobs", [TokenLogprob]) once, before the first
        tokens."""
        with_text = bool(sampling.get("text") or sampling.get("messages"))
        for msg in self.generate_stream(self.generate_request(input_ids, images, **sampling), timeout):
            if msg.HasField("tokens"):
                if msg.tokens.prompt_logprobs:
                    yield "prompt_logprobs", list(msg.tokens.prompt_logprobs)
                if msg.tokens.token_ids:
                    yield "tokens", list(msg.tokens.token_ids)
                if with_text and msg.tokens.text:
                    yield "text", msg.tokens.text
                if msg.tokens.logprobs:
                    yield "logprobs", list(msg.tokens.logprobs)
            elif msg.HasField("summary"):
                yield "summary", msg.summary

    def chat(self, messages, timeout=None, **sampling):
        """(reply text, summary) of a chat: messages as chat_messages() takes them."""
        text, summary = [], None
        for kind, value in self.generate(messages=messages, timeout=timeout, **sampling):
            if kind == "text":
                text.append(value)
            elif kind == "summary":
                summary = value
        return "".join(text), summary

    def generate_all(self, input_ids=(), images=None, timeout=None, **sampling):
        """(all new token ids, summary)."""
        tokens, summary = [], None
        for kind, value in self.generate(input_ids, images, timeout, **sampling):
            if kind == "tokens":
                tokens.extend(value)
            elif kind == "summary":
                summary = value
        return tokens, summary

    def forward(self, input_ids=(), images=None, target_ids=(), logits_positions=(), timeout=None, text="",
                messages=None, target_next_tokens=False):
        req = self.pb.forward_pb2.ForwardRequest(input_ids=list(input_ids), images=_as_images(images),
                                                 target_ids=list(target_ids),
                                                 logits_positions=list(logits_positions), text=text,
                                                 messages=chat_messages(messages or []),
                                                 target_next_tokens=target_next_tokens)
        return self.stub.Forward(req, timeout=timeout or self.timeout)

    def train_config(self, **kwargs):
        """A TrainConfig: language_learning_rate=..., trainable_parts=["LANGUAGE", ...],
        recompute_parts=["VISION", ...], ..."""
        t = self.pb.train_pb2
        part_lists = {f: kwargs.pop(f, None) or [] for f in ("trainable_parts", "recompute_parts")}
        cfg = t.TrainConfig(**kwargs)
        for field, parts in part_lists.items():
            getattr(cfg, field).extend(t.ModelPart.Value(f"MODEL_PART_{p.upper()}") for p in parts)
        return cfg

    def train_batch(self, examples):
        """A TrainRequest{batch} from dicts {input_ids, target_ids, images (bytes or Image)}, or
        chat examples {messages: [{"role": ..., "content": str | [str | bytes | Image, ...]}]}
        (the server tokenizes them; the loss covers the assistant turns)."""
        t = self.pb.train_pb2

        def example(e):
            if "messages" in e:
                return t.TrainExample(messages=chat_messages(e["messages"]))
            return t.TrainExample(input_ids=list(e["input_ids"]), target_ids=list(e["target_ids"]),
                                  images=_as_images(e.get("images")))

        return t.TrainRequest(batch=t.TrainBatch(examples=[example(e) for e in examples]))

    def train_save(self, directory):
        t = self.pb.train_pb2
        return t.TrainRequest(save=t.SaveCheckpoint(directory=directory))

    def train_publish(self):
        """Makes the job's current weights the serving weights (TrainResponse{published}), if the
        server's publish gate accepts them. Needs a key with the `publish` scope."""
        t = self.pb.train_pb2
        return t.TrainRequest(publish=t.PublishWeights())

    def rollback_weights(self, timeout=None):
        """Restores the weights served before the last publish (RollbackWeightsResponse). Needs a
        key with the `publish` scope; FAILED_PRECONDITION when there is nothing to roll back."""
        req = self.pb.train_pb2.RollbackWeightsRequest()
        return self.stub.RollbackWeights(req, timeout=timeout or self.timeout)

    def train(self, config, requests, timeout=None):
        """Streams TrainRequest{config} then `requests` (TrainRequest messages); yields TrainResponses.
        The job ends when `requests` is exhausted (the client half-closes)."""
        t = self.pb.train_pb2

        def messages():
            yield t.TrainRequest(config=config)
            yield from requests

        return self.stub.Train(messages(), timeout=timeout or self.timeout)
