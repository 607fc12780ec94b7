
#compdef resilrun

_resilrun_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _RESILRUN_COMPLETE=complete_zsh resilrun)
}

compdef _resilrun_completion resilrun

