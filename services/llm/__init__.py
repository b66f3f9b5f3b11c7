"""Engine code the LLM services share (tokenizer, prefill, decode, the router): the model
and its artifacts, the KV cache, its wire codec and its transfer client, sampling,
decode's stopping on ids, and the request checks. Not a service itself: servicers live in
services/<name>/.
"""
