{{- /*
Shared helpers of the four meshlm component charts, the one copy: each chart depends on this
library chart (charts/meshlm-lib links here). Every helper takes
(dict "ctx" $ "component" "<gateway|tokenizer|scheduler|detokenizer>"), reads the calling chart's
values and metadata through .ctx, and never reads .Chart.Name, which an umbrella alias changes.

Naming: every resource of a component is "<system>-meshlm-<component>", where <system> is
global.meshlm.system or, when empty, the release name. A standalone chart therefore finds its
peers at "<system>-meshlm-<peer>-headless:<default port>" when all are installed with the same
global.meshlm.system, and the umbrella chart gets the same names from its one release name.
The documents every chart renders the same way (headless Service, HPA, PDB, ServiceMonitor) are
in _documents.tpl.
*/ -}}

{{- define "meshlm.system" -}}
{{- $g := (.ctx.Values.global | default dict).meshlm | default dict -}}
{{- $g.system | default .ctx.Release.Name | trunc 30 | trimSuffix "-" -}}
{{- end -}}

{{- /* An optional "name" replaces the component in resource names and the name label (the
scheduler chart's decode role: "scheduler-decode", beside the prefill "scheduler"). */ -}}
{{- define "meshlm.fullname" -}}
{{- printf "%s-meshlm-%s" (include "meshlm.system" .) (.name | default .component) -}}
{{- end -}}

{{- define "meshlm.selectorLabels" -}}
app.kubernetes.io/name: meshlm-{{ .name | default .component }}
meshlm.io/system: {{ include "meshlm.system" . }}
{{- end -}}

{{- define "meshlm.labels" -}}
{{ include "meshlm.selectorLabels" . }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: meshlm
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: meshlm-{{ .component }}-{{ .ctx.Chart.Version | replace "+" "_" }}
{{- end -}}

{{- /* (dict "ctx" $ "image" <image values> "tag" <default tag>) -> registry/repository:tag */ -}}
{{- define "meshlm.image" -}}
{{- $g := (.ctx.Values.global | default dict).meshlm | default dict -}}
{{- $repo := .image.repository -}}
{{- if $g.imageRegistry -}}{{- $repo = printf "%s/%s" (trimSuffix "/" $g.imageRegistry) $repo -}}{{- end -}}
{{- printf "%s:%s" $repo (.image.tag | default .tag) -}}
{{- end -}}

{{- /* (dict "ctx" $ "value" <explicit list or ""> "peer" <component> "port" <int>) */ -}}
{{- define "meshlm.peerAddrs" -}}
{{- if .value -}}
{{- .value -}}
{{- else -}}
{{- printf "%s-meshlm-%s-headless:%d" (include "meshlm.system" .) .peer (int .port) -}}
{{- end -}}
{{- end -}}

{{- /* The drain budget: SIGTERM arrives after the preStop sleep, and both must fit in the pod's
terminationGracePeriodSeconds with 5 s to spare for the final server stop. */ -}}
{{- define "meshlm.gracePeriodS" -}}
{{- $v := .ctx.Values -}}
{{- $grace := sub (sub (int $v.terminationGracePeriodSeconds) (int $v.preStopSleepSeconds)) 5 -}}
{{- if lt $grace 1 -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds (%d) + 5 so the service has time to drain" (int $v.terminationGracePeriodSeconds) (int $v.preStopSleepSeconds)) -}}
{{- end -}}
{{- $grace -}}
{{- end -}}

{{- define "meshlm.validate" -}}
{{- $v := .ctx.Values -}}
{{- if $v.tls.enabled -}}
{{- $_ := required "tls.secretName is required when tls.enabled=true: name a kubernetes.io/tls Secret holding tls.crt, tls.key and ca.crt" $v.tls.secretName -}}
{{- if and (ne .component "gateway") (eq (int $v.tls.healthPort) (int $v.service.port)) -}}
{{- fail (printf "tls.healthPort (%d) must differ from service.port" (int $v.tls.healthPort)) -}}
{{- end -}}
{{- if and (ne .component "gateway") $v.metrics.enabled (eq (int $v.tls.healthPort) (int $v.metrics.port)) -}}
{{- fail (printf "tls.healthPort (%d) must differ from metrics.port" (int $v.tls.healthPort)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* ---- authentication: global.meshlm.auth ----------------------------------------------
The API key (gateway: HTTP; tokenizer: its public gRPC API) and the ring's internal token (every
component sends it on each call to a peer and requires it on its internal RPCs) come from one
existing Secret, mounted as files under meshlm.authDir and passed as --api-key-file /
--internal-token-file: never in args or plain env. An empty key name leaves that secret out. */ -}}
{{- define "meshlm.authDir" -}}/etc/meshlm/auth{{- end -}}

{{- define "meshlm.auth" -}}
{{- $g := (.ctx.Values.global | default dict).meshlm | default dict -}}
{{- toJson ($g.auth | default dict) -}}
{{- end -}}

{{- /* The Secret's items this component mounts, as JSON ([] without an existingSecret). */ -}}
{{- define "meshlm.authItems" -}}
{{- $a := include "meshlm.auth" . | fromJson -}}
{{- $items := list -}}
{{- if $a.existingSecret -}}
{{- if and $a.apiKeyKey (has .component (list "gateway" "tokenizer")) -}}
{{- $items = append $items (dict "key" $a.apiKeyKey "path" "api-key") -}}
{{- end -}}
{{- if $a.internalTokenKey -}}
{{- $items = append $items (dict "key" $a.internalTokenKey "path" "internal-token") -}}
{{- end -}}
{{- end -}}
{{- toJson $items -}}
{{- end -}}

{{- define "meshlm.authArgs" -}}
{{- range (include "meshlm.authItems" . | fromJsonArray) }}
{{- if eq .path "api-key" }}
- --api-key-file={{ include "meshlm.authDir" $ }}/api-key
{{- else }}
- --internal-token-file={{ include "meshlm.authDir" $ }}/internal-token
{{- end }}
{{- end }}
{{- end -}}

{{- /* mTLS: the Secret's files under this directory (tls.enabled). */ -}}
{{- define "meshlm.tlsDir" -}}/etc/meshlm/tls{{- end -}}

{{- /* The gRPC probes' port: the service port, or the plaintext health port under TLS (the
kubelet's gRPC probes cannot speak TLS). */ -}}
{{- define "meshlm.probePort" -}}
{{- $v := .ctx.Values -}}
{{- if $v.tls.enabled -}}{{ $v.tls.healthPort }}{{- else -}}{{ $v.service.port }}{{- end -}}
{{- end -}}

{{- /* Flags every service takes, as container args. */ -}}
{{- define "meshlm.commonArgs" -}}
{{- $v := .ctx.Values -}}
- --host=0.0.0.0
- --port={{ $v.service.port }}
- --log-level={{ $v.logLevel }}
- --log-format={{ $v.logFormat }}
- --grace-period-s={{ include "meshlm.gracePeriodS" . }}
{{- if $v.otlp.endpoint }}
- --otlp-endpoint={{ $v.otlp.endpoint }}
{{- end }}
{{- if and $v.metrics.enabled (ne .component "gateway") }}
- --metrics-port={{ $v.metrics.port }}
{{- end }}
{{- if $v.tls.enabled }}
- --tls-cert-file={{ include "meshlm.tlsDir" . }}/tls.crt
- --tls-key-file={{ include "meshlm.tlsDir" . }}/tls.key
- --tls-ca-file={{ include "meshlm.tlsDir" . }}/ca.crt
{{- if ne .component "gateway" }}
- --health-port={{ $v.tls.healthPort }}
{{- end }}
{{- end }}
{{- include "meshlm.authArgs" . }}
{{- end -}}

{{- /* extraArgs / extraEnv render nothing when empty; callers wrap them in `with` and
`trim | nindent N`. */ -}}
{{- define "meshlm.extraArgs" -}}
{{- range .ctx.Values.extraArgs }}
{{ printf "- %s" (quote .) }}
{{- end }}
{{- end -}}

{{- /* Writable locations under a read-only root file system: /tmp and /cache are emptyDirs. */ -}}
{{- define "meshlm.cacheEnv" -}}
- name: TMPDIR
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: MESHLM_CACHE
  value: {{ .meshlmCache | default "/cache/meshlm" }}
- name: HF_HOME
  value: /cache/huggingface
- name: HF_HUB_OFFLINE
  value: "1"
{{- end -}}

{{- define "meshlm.extraEnv" -}}
{{- with .ctx.Values.extraEnv }}{{ toYaml . }}{{ end }}
{{- end -}}

{{- define "meshlm.metricsPort" -}}
{{- if and .ctx.Values.metrics.enabled (ne .component "gateway") -}}
- name: metrics
  containerPort: {{ .ctx.Values.metrics.port }}
  protocol: TCP
{{- end -}}
{{- end -}}

{{- /* The plaintext grpc.health.v1 port of a gRPC service under TLS (its probes' target). */ -}}
{{- define "meshlm.healthPort" -}}
{{- if and .ctx.Values.tls.enabled (ne .component "gateway") -}}
- name: health
  containerPort: {{ .ctx.Values.tls.healthPort }}
  protocol: TCP
{{- end -}}
{{- end -}}

{{- define "meshlm.modelVolumeMount" -}}
- name: models
  mountPath: /models
  readOnly: true
{{- end -}}

{{- define "meshlm.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      # Let endpoint removal reach every client before SIGTERM starts the drain.
      command: ["sleep", "{{ .ctx.Values.preStopSleepSeconds }}"]
{{- end -}}

{{- define "meshlm.podSpecCommon" -}}
{{- $v := .ctx.Values -}}
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "meshlm.podMetadata" -}}
labels:
  {{- include "meshlm.labels" . | nindent 2 }}
  {{- with .ctx.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .ctx.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- /* gRPC health probes (grpc.health.v1, served by every internal service; under TLS on the
plaintext health port). */ -}}
{{- define "meshlm.grpcProbes" -}}
{{- $v := .ctx.Values -}}
{{- $port := include "meshlm.probePort" . -}}
startupProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: {{ $v.startupProbe.periodSeconds }}
  failureThreshold: {{ $v.startupProbe.failureThreshold }}
  timeoutSeconds: 5
livenessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
readinessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
{{- end -}}

{{- /* ---- model files (scheduler: the model; tokenizer/detokenizer: its tokenizer) ----------- */ -}}

{{- define "meshlm.modelPath" -}}
{{- $m := .ctx.Values.model -}}
{{- if eq $m.source "init" -}}
/models/model
{{- else -}}
{{- printf "/models/%s" (trimPrefix "/" $m.path) | trimSuffix "/" -}}
{{- end -}}
{{- end -}}

{{- define "meshlm.modelVolume" -}}
{{- $m := .ctx.Values.model -}}
- name: models
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source=hostPath" $m.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir:
    sizeLimit: {{ $m.init.sizeLimit }}
{{- end }}
{{- end -}}

{{- /* Runs resolve_model_path in an image that has the scheduler extra (converting the packaged
GGUF, or model.init.source, into the emptyDir) and links the result to /models/model.
(dict "ctx" $ "component" c "initImage" <image reference>) */ -}}
{{- define "meshlm.modelInitContainer" -}}
{{- $v := .ctx.Values -}}
{{- $m := $v.model -}}
{{- if eq $m.source "init" }}
- name: prepare-model
  image: {{ .initImage }}
  imagePullPolicy: {{ $m.init.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import os, pathlib
      from meshlm.scheduler.model_loader import resolve_model_path
      src = resolve_model_path(os.environ["MESHLM_MODEL_SOURCE"] or None)
      link = pathlib.Path(os.environ["MESHLM_MODEL_DIR"])
      if link.is_symlink() or link.exists():
          link.unlink()
      link.symlink_to(src, target_is_directory=True)
      print(f"model ready: {link} -> {src}", flush=True)
  env:
    {{- include "meshlm.cacheEnv" (dict "meshlmCache" "/models/cache") | nindent 4 }}
    - name: MESHLM_MODEL_SOURCE
      value: {{ $m.init.source | quote }}
    - name: MESHLM_MODEL_DIR
      value: /models/model
  {{- with $m.init.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: models
      mountPath: /models
    - name: tmp
      mountPath: /tmp
    - name: cache
      mountPath: /cache
{{- end }}
{{- end -}}

{{- /* /tmp and /cache, and the TLS Secret when tls.enabled (mode 0440: readable by the
non-root user through podSecurityContext.fsGroup). */ -}}
{{- define "meshlm.baseVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .ctx.Values.tls.secretName }}
    defaultMode: 288
{{- end }}
{{- with (include "meshlm.authItems" . | fromJsonArray) }}
- name: auth
  secret:
    secretName: {{ (include "meshlm.auth" $ | fromJson).existingSecret }}
    defaultMode: 288
    items:
      {{- toYaml . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "meshlm.baseVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- if .ctx.Values.tls.enabled }}
- name: tls
  mountPath: {{ include "meshlm.tlsDir" . }}
  readOnly: true
{{- end }}
{{- if (include "meshlm.authItems" . | fromJsonArray) }}
- name: auth
  mountPath: {{ include "meshlm.authDir" . }}
  readOnly: true
{{- end }}
{{- end -}}
