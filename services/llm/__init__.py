"""Engine code the LLM services share (tokenizer, prefill, decode, the router): the model
and its artifacts, the KV cache, its wire codec and its transfer client, sampling,
stopping and request validation. Not a service itself: servicers live in
services/<name>/.
"""
