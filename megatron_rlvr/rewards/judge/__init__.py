"""The LLM judge (`judge`): a judge model reads the prompt, the response and (reference
template) the record's answer, and replies `Score: N`; N is normalised to [0, 1]. The judge is
served by the run with the rollout engines' launcher (serving.py) or is an external
OpenAI-compatible endpoint; requests go through the `openai` client with retries, a bound on
concurrency and a cache (client.py); templates.py holds the prompts and reads the score;
verifier.py turns a group's replies into verdicts, and a group the judge could not score into
a dropped one (rewards None: the buffer counts it as dropped_unscored)."""
