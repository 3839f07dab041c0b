"""Tiny random-weight pooling models, built by the tests and cached as tiny_models.py's are.

- `tiny_bert_embedding_path(pooling, normalize)`: a sentence-transformers folder over a BertModel
  (hidden 64, 2 layers, 64 positions, a small WordPiece vocabulary): modules.json, 1_Pooling,
  optionally 2_Normalize, sentence_bert_config.json.
- `tiny_encoder_embedding_path(family)`: the same over XLM-RoBERTa or ModernBERT.
- `tiny_qwen3_embedding_path()`: the same layout over a Qwen3 decoder (SmolLM2's tokenizer),
  last-token pooling and Normalize, as Qwen3-Embedding; `family` "qwen2" (gte-Qwen2's body) or
  "llama" and another `pooling` too.
- `tiny_bert_classifier_path(num_labels)`: BertForSequenceClassification; one label is a
  cross-encoder reranker, several a classifier with `id2label`.
- `tiny_qwen3_reranker_path(num_labels)`: Qwen3ForSequenceClassification, one label or several.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tests.helpers.tiny_models import _cached_folder, _save_tokenizer

WORDS = ("the a an is are was of to in on for and or not what who where when how why which deep learning "
         "machine model paris france capital city food delicious waiter river bank money water fish "
         "cat dog runs sat mat hello world good bad great terrible love like hate i you we they it "
         "this that question answer query document text search find relevant about branch science "
         "computer network neural data").split()
_BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
         "max_position_embeddings": 64, "initializer_range": 0.2}
_QWEN3 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
          "initializer_range": 0.2, "attention_bias": False}


def _bert_tokenizer(out: Path) -> int:
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    chars = string.ascii_lowercase + string.digits + string.punctuation
    vocab += [c for c in chars if c not in vocab] + [f"##{c}" for c in string.ascii_lowercase + string.digits]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), model_max_length=64)
    tokenizer.save_pretrained(out)
    return len(vocab)


def _sentence_transformers_files(out: Path, pooling: str, normalize: bool, dim: int, max_seq_length: int) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir()
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir()
    flags = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    config = {"word_embedding_dimension": dim, **{flag: mode == pooling for mode, flag in flags.items()},
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                               "do_lower_case": False}))


def tiny_bert_embedding_path(pooling: str = "mean", normalize: bool = True, seed: int = 0) -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import BertConfig, BertModel

        vocab_size = _bert_tokenizer(out)
        torch.manual_seed(seed)
        BertModel(BertConfig(vocab_size=vocab_size, **_BERT)).eval().save_pretrained(out)
        _sentence_transformers_files(out, pooling, normalize, _BERT["hidden_size"], 64)

    return _cached_folder("tiny-bert-embedding", {"pooling": pooling, "normalize": normalize, "seed": seed,
                                                  "shape": _BERT}, build)


ENCODERS = {  # family -> (config class, model class, config beside the vocabulary)
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", {**_BERT, "max_position_embeddings": 66, "pad_token_id": 0}),
    "modernbert": ("ModernBertConfig", "ModernBertModel", {**_BERT, "num_hidden_layers": 3, "pad_token_id": 0,
                                                           "local_attention": 8}),
}


def tiny_encoder_embedding_path(family: str, seed: int = 0) -> Path:
    """A sentence-transformers folder (mean pooling, Normalize) over a tiny XLM-RoBERTa or
    ModernBERT encoder with the small WordPiece vocabulary."""
    config_class, model_class, config = ENCODERS[family]

    def build(out: Path) -> None:
        import torch
        import transformers

        vocab_size = _bert_tokenizer(out)
        torch.manual_seed(seed)
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(vocab_size=vocab_size, **config))
        model.eval().save_pretrained(out)
        _sentence_transformers_files(out, "mean", True, config["hidden_size"], 64)

    return _cached_folder(f"tiny-{family}-embedding", {"seed": seed, "config": config}, build)


DECODERS = {  # family -> (config class, model class): bare bodies, saved as sentence-transformers' Transformer
    "qwen3": ("Qwen3Config", "Qwen3Model"),
    "qwen2": ("Qwen2Config", "Qwen2Model"),  # gte-Qwen2's body (q/k/v biases)
    "llama": ("LlamaConfig", "LlamaModel"),
}


def tiny_qwen3_embedding_path(seed: int = 0, family: str = "qwen3", pooling: str = "lasttoken") -> Path:
    """A decoder body (Qwen3 by default) with SmolLM2's tokenizer, `pooling` and Normalize."""
    config_class, model_class = DECODERS[family]

    def build(out: Path) -> None:
        import torch
        import transformers

        vocab_size = _save_tokenizer(out)
        torch.manual_seed(seed)
        shape = {k: v for k, v in _QWEN3.items() if family != "llama" or k != "attention_bias"}
        config = getattr(transformers, config_class)(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, **shape)
        getattr(transformers, model_class)(config).eval().save_pretrained(out)
        _sentence_transformers_files(out, pooling, True, _QWEN3["hidden_size"], 256)

    return _cached_folder(f"tiny-{family}-embedding", {"seed": seed, "shape": _QWEN3, "pooling": pooling}, build)


def tiny_bert_classifier_path(num_labels: int = 1, seed: int = 0) -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import BertConfig, BertForSequenceClassification

        vocab_size = _bert_tokenizer(out)
        labels = {i: name for i, name in enumerate(["negative", "neutral", "positive", "other"][:num_labels])}
        config = BertConfig(vocab_size=vocab_size, num_labels=num_labels, **_BERT,
                            **({} if num_labels == 1 else {"id2label": labels,
                                                          "label2id": {v: k for k, v in labels.items()}}))
        torch.manual_seed(seed)
        BertForSequenceClassification(config).eval().save_pretrained(out)

    return _cached_folder("tiny-bert-classifier", {"num_labels": num_labels, "seed": seed, "shape": _BERT}, build)


def tiny_qwen3_reranker_path(seed: int = 0, num_labels: int = 1) -> Path:
    """Qwen3ForSequenceClassification: one label a cross-encoder, several a classifier (`id2label`)."""
    def build(out: Path) -> None:
        import torch
        from transformers import Qwen3Config, Qwen3ForSequenceClassification

        vocab_size = _save_tokenizer(out)
        labels = {i: name for i, name in enumerate(["negative", "neutral", "positive", "other"][:num_labels])}
        config = Qwen3Config(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                             num_labels=num_labels, **_QWEN3,
                             **({} if num_labels == 1 else {"id2label": labels,
                                                           "label2id": {v: k for k, v in labels.items()}}))
        torch.manual_seed(seed)
        Qwen3ForSequenceClassification(config).eval().save_pretrained(out)

    return _cached_folder("tiny-qwen3-reranker", {"seed": seed, "shape": _QWEN3, "labels": num_labels}, build)
