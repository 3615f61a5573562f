"""Text and chat over gRPC with the real model (SmolLM2-135M-Instruct converted by
tools/convert_gguf.py): the server tokenizes, renders the chat template, streams text, stops on
the model's end of turn and on stop strings. References: Hugging Face tokenizers and transformers'
apply_chat_template on the same checkpoint."""
import os
import re
import subprocess
import unittest

import grpc

from e2e_util import ROOT, Server, chelsea, converted_model, require

FRANCE = "What is the capital of France? Answer in one sentence."


class TextTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            import tokenizers  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            require(False, "Python packages tokenizers and transformers")
        cls.model_dir = converted_model()
        cls.server = Server({"model": cls.model_dir}, name="text").start()
        cls.client = cls.server.client()
        cls.info = cls.client.model_info()
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer
        cls.hf = Tokenizer.from_file(f"{cls.model_dir}/tokenizer.json")
        cls.hf_chat = AutoTokenizer.from_pretrained(cls.model_dir)

    @classmethod
    def tearDownClass(cls):
        cls.server.finish(cls.client)

    def template_ids(self, messages, add_generation_prompt):
        """transformers' rendering of the checkpoint's chat template, tokenized by tokenizers."""
        text = self.hf_chat.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=False)
        return self.hf.encode(text, add_special_tokens=False).ids

    def chat(self, content, **sampling):
        sampling.setdefault("max_new_tokens", 32)
        tokens, texts, summary = [], [], None
        for kind, value in self.client.generate(messages=[{"role": "user", "content": content}], **sampling):
            if kind == "tokens":
                tokens.extend(value)
            elif kind == "text":
                texts.append(value)
            else:
                summary = value
        return tokens, "".join(texts), summary

    def test_model_info_reports_tokenizer_and_chat_format(self):
        self.assertTrue(self.info.tokenizer.endswith("tokenizer.json"))
        self.assertEqual(self.info.chat_format, "chatml")
        im_end = self.hf.token_to_id("<|im_end|>")
        self.assertIn(im_end, list(self.info.suggested_stop_token_ids))
        self.assertEqual(self.info.served_model_name, "smollm2-135m-512")

    def test_chat_answers_and_stops_at_end_of_turn(self):
        tokens, text, summary = self.chat(FRANCE, max_new_tokens=48)
        self.assertIn("Paris", text)
        pb = self.client.pb.generate_pb2
        self.assertEqual(summary.finish_reason, pb.FINISH_REASON_STOP_TOKEN, text)
        self.assertEqual(tokens[-1], self.hf.token_to_id("<|im_end|>"))
        # The streamed text is the reference detokenization of the streamed ids.
        self.assertEqual(text, self.hf.decode(tokens, skip_special_tokens=True))
        # The prompt is transformers' rendering of the model's own template.
        expected = self.template_ids([{"role": "user", "content": FRANCE}], add_generation_prompt=True)
        self.assertEqual(summary.prompt_tokens, len(expected))

    def test_forward_of_messages_uses_the_chat_template_ids(self):
        messages = [{"role": "user", "content": FRANCE}, {"role": "assistant", "content": "Paris."}]
        r = self.client.forward(messages=messages, target_next_tokens=True)
        expected = self.template_ids(messages, add_generation_prompt=False)
        self.assertEqual(list(r.input_ids), list(expected))
        self.assertEqual(r.loss_tokens, len(expected) - 1)
        self.assertGreater(r.loss, 0)

    def test_plain_text_prompt_streams_text(self):
        tokens, summary = self.client.generate_all(text="The capital of France is", max_new_tokens=8,
                                                   ignore_eos=True)
        self.assertEqual(len(tokens), 8)
        self.assertEqual(summary.prompt_tokens, len(self.hf.encode("The capital of France is").ids))

    def test_stop_string_cuts_the_text(self):
        _, full, _ = self.chat(FRANCE, max_new_tokens=48)
        self.assertIn("Paris", full)
        _, text, summary = self.chat(FRANCE, max_new_tokens=48, stop=["Paris"])
        self.assertEqual(text, full[:full.index("Paris")])
        self.assertEqual(summary.finish_reason, self.client.pb.generate_pb2.FINISH_REASON_STOP_STRING)

    def test_chat_with_an_image(self):
        _, text, summary = self.chat([chelsea(), "What is in this picture?"], max_new_tokens=8)
        # One 512 px tile: the global image token and 64 image tokens before the question.
        self.assertEqual(summary.image_tiles, 1)
        self.assertGreater(summary.prompt_tokens, 64)
        self.assertGreater(summary.generated_tokens, 0)

    def test_bad_text_requests_are_refused(self):
        with self.assertRaises(grpc.RpcError) as e:
            self.client.generate_all(input_ids=[1, 2], text="both")
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        with self.assertRaises(grpc.RpcError) as e:
            self.client.generate_all(messages=[{"role": "tool", "content": "x"}])
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("role", e.exception.details())
        with self.assertRaises(grpc.RpcError) as e:
            self.client.generate_all(text="hi", stop=[""])
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        # The server keeps serving.
        self.assertIn("Paris", self.chat(FRANCE, max_new_tokens=48)[1])


class NoTokenizerTest(unittest.TestCase):
    def test_text_needs_a_tokenizer(self):
        server = Server(name="no-tokenizer").start()
        client = server.client()
        try:
            self.assertEqual(client.model_info().tokenizer, "")
            with self.assertRaises(grpc.RpcError) as e:
                client.generate_all(text="hello")
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("tokenizer", e.exception.details())
        finally:
            server.finish(client)


class ServeScriptTest(unittest.TestCase):
    """scripts/serve.sh, the README's quick start: flags other than --model and --config keep the
    default model (the converted SmolLM2) and its CPU settings, and the banner names the HTTP
    address the server will listen on."""

    def test_flags_keep_the_default_model(self):
        model = converted_model(512)
        build = os.path.dirname(os.path.dirname(os.environ["VLMGRAPH_SERVER"]))
        env = dict(os.environ, VLMGRAPH_SERVE_SKIP_BUILD="1", BUILD_DIR=build, VLMGRAPH_MODEL_DIR=model)
        for flags in (["--http-address", "127.0.0.1:9123"], ["--http-address=127.0.0.1:9123"]):
            out = subprocess.run([os.path.join(ROOT, "scripts", "serve.sh"), *flags, "--print-config"],
                                 capture_output=True, text=True, timeout=600, env=env)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            self.assertIn("curl -s 127.0.0.1:9123/v1/models", out.stdout)
            self.assertRegex(out.stdout, r"(?m)^model: " + re.escape(model) + "$")
            self.assertRegex(out.stdout, r"(?m)^  http_address: 127\.0\.0\.1:9123$")
            self.assertIn("default_max_new_tokens: 256", out.stdout)


if __name__ == "__main__":
    unittest.main()
