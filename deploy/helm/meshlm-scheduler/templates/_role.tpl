{{- /* The scheduler's resource name: "scheduler" for roles unified and prefill (tokenizers find
it by default), "scheduler-decode" for role decode, so a decode StatefulSet and its headless
service live beside the prefill ones of the same system (prefill's default --decode-addrs). */ -}}
{{- define "meshlm-scheduler.name" -}}
{{- if eq .Values.role "decode" -}}scheduler-decode{{- else -}}scheduler{{- end -}}
{{- end -}}
