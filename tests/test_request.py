"""Request stop conditions: stop strings found across multi-byte characters, checking only the output's tail."""

from serving.request import Request
from serving.sampling import SamplingParams


def test_stop_string_split_across_tokens_and_characters_is_found_from_the_tail():
    text = "a" * 300 + "héé!" + "zzz"
    tokens = list(text.encode())  # one byte per token: "é" is split over two tokens
    lengths = []

    def detokenize(ids):
        lengths.append(len(ids))
        return bytes(ids).decode(errors="replace")

    request = Request("r", [1], SamplingParams(stop=["é!", "never"], max_tokens=1000, seed=0))
    for token in tokens:
        request.accept(token, None, None, detokenize)
        if request.finish_reason:
            break
    assert request.finish_reason == "stop" and request.text == "a" * 300 + "hé"
    assert request.output == tokens[: len(("a" * 300 + "héé!").encode())]
    assert max(lengths[:-1]) <= 4 * len("never") + 4  # only the confirming decode reads the whole output
