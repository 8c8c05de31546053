"""Output processing: the incremental detokenizer, the finish rules, the tool-call parser, and the
RequestOutput/StepOutput records."""
