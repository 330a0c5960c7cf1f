{{- /*
Documents every meshlm component chart renders the same way, as named templates of the library
chart: the headless Service, the HPA, the PDB and the ServiceMonitor. Each takes the helpers'
(dict "ctx" $ "component" c ...) of _meshlm.tpl.
*/ -}}
{{- /* (dict "ctx" $ "component" c "portName" "grpc"|"http") */ -}}
{{- define "meshlm.headlessService" -}}
{{- $v := .ctx.Values -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "meshlm.fullname" . }}-headless
  labels:
    {{- include "meshlm.labels" . | nindent 4 }}
    meshlm.io/service: headless
spec:
  type: ClusterIP
  clusterIP: None
  # Only ready pods are listed: peers re-resolve this name to find every replica.
  publishNotReadyAddresses: false
  selector:
    {{- include "meshlm.selectorLabels" . | nindent 4 }}
  ports:
    - name: {{ .portName }}
      port: {{ $v.service.port }}
      targetPort: {{ .portName }}
      protocol: TCP
    {{- if and $v.metrics.enabled (ne .component "gateway") }}
    - name: metrics
      port: {{ $v.metrics.port }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
{{- end -}}

{{- /* (dict "ctx" $ "component" c "kind" "Deployment"|"StatefulSet") */ -}}
{{- define "meshlm.hpa" -}}
{{- $a := .ctx.Values.autoscaling -}}
{{- if $a.enabled -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "meshlm.fullname" . }}
  labels:
    {{- include "meshlm.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ .kind }}
    name: {{ include "meshlm.fullname" . }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- with $a.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ . }}
    {{- end }}
    {{- with $a.targetMemoryUtilizationPercentage }}
    - type: Resource
      resource:
        name: memory
        target:
          type: Utilization
          averageUtilization: {{ . }}
    {{- end }}
  {{- with $a.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
{{- end -}}

{{- define "meshlm.pdb" -}}
{{- $p := .ctx.Values.pdb -}}
{{- if $p.enabled -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "meshlm.fullname" . }}
  labels:
    {{- include "meshlm.labels" . | nindent 4 }}
spec:
  {{- if ne (toString $p.minAvailable) "" }}
  minAvailable: {{ $p.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $p.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "meshlm.selectorLabels" . | nindent 6 }}
{{- end -}}
{{- end -}}

{{- /* (dict "ctx" $ "component" c "port" <port name to scrape>) */ -}}
{{- define "meshlm.serviceMonitor" -}}
{{- $m := .ctx.Values.metrics -}}
{{- if and $m.enabled $m.serviceMonitor.enabled -}}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "meshlm.fullname" . }}
  labels:
    {{- include "meshlm.labels" . | nindent 4 }}
    {{- with $m.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "meshlm.selectorLabels" . | nindent 6 }}
      meshlm.io/service: headless
  namespaceSelector:
    matchNames:
      - {{ .ctx.Release.Namespace }}
  endpoints:
    - port: {{ .port }}
      path: /metrics
      interval: {{ $m.serviceMonitor.interval }}
      scrapeTimeout: {{ $m.serviceMonitor.scrapeTimeout }}
{{- end -}}
{{- end -}}
