{{/* Names, labels and the pieces every component's pod shares. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "tandem.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "tandem.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The name of one component's objects: (dict "root" $ "component" "draft") */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* mode ray: KubeRay's Service of the head (Generate, and Ray's GCS for the workers). With TLS on, the certificate
names it: clients dial it, and the services, bound to pod addresses, check each other's certificates for it. */}}
{{- define "tandem.rayHeadServiceName" -}}
{{- printf "%s-head-svc" (include "tandem.fullname" .) }}
{{- end }}

{{/* mode ray: a label selector of the RayCluster's own pods, the head and both worker groups (the component labels
raycluster.yaml gives their templates). */}}
{{- define "tandem.rayPodSelector" -}}
matchLabels:
  app.kubernetes.io/name: {{ include "tandem.name" . }}
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: ["ray-head", "target", "draft"]
{{- end }}

{{- define "tandem.draftHeadlessName" -}}
{{- printf "%s-draft-headless" (include "tandem.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* (dict "root" $ "component" "target") */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.componentLabels" -}}
{{ include "tandem.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Where every service finds the target: its Service's name (the certificate's name with TLS on). */}}
{{- define "tandem.targetAddress" -}}
{{- printf "%s:%d" (include "tandem.componentName" (dict "root" . "component" "target")) (int .Values.target.port) }}
{{- end }}

{{/* What the orchestrator resolves for draft replicas: the headless Service, fully qualified. */}}
{{- define "tandem.draftDns" -}}
{{- printf "%s.%s.svc.%s:%d" (include "tandem.draftHeadlessName" .) .Release.Namespace .Values.clusterDomain (int .Values.draft.port) }}
{{- end }}

{{- define "tandem.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert={{ .Values.tls.mountPath }}/tls.crt
- --tls-key={{ .Values.tls.mountPath }}/tls.key
- --tls-ca={{ .Values.tls.mountPath }}/ca.crt
{{- end }}
{{- end }}

{{/* A probe on a gRPC port: grpc.health.v1 Check (the whole server, service ""). kubelet's gRPC probe speaks
plaintext only, so with TLS on the probe checks that the port accepts connections.
(dict "root" $ "port" 50061 "settings" .Values.target.startupProbe) */}}
{{- define "tandem.probe" -}}
{{- if .root.Values.tls.enabled }}
tcpSocket:
  port: {{ .port }}
{{- else }}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
{{- with .settings }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Environment every service gets: caches under the writable /tmp (the root file system is read-only). */}}
{{- define "tandem.commonEnv" -}}
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /tmp/huggingface
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}

{{- define "tandem.modelVolumeMount" -}}
{{- if ne .Values.models.source "image" }}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The TLS Secret's files (tls.crt, tls.key, ca.crt) under tls.mountPath, with tls.enabled. */}}
{{- define "tandem.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.existingSecret: the Secret with tls.crt, tls.key and ca.crt is required with tls.enabled" .Values.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "tandem.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- with (include "tandem.tlsVolumeMount" . | trim) }}
{{ . }}
{{- end }}
{{- end }}

{{- define "tandem.modelVolume" -}}
{{- if eq .Values.models.source "persistentVolumeClaim" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.models.claimName }}
    readOnly: true
{{- else if eq .Values.models.source "hostPath" }}
- name: models
  hostPath:
    path: {{ .Values.models.hostPath }}
    type: Directory
{{- end }}
{{- end }}

{{- define "tandem.commonVolumes" -}}
- name: tmp
  emptyDir: {}
{{- with (include "tandem.tlsVolume" . | trim) }}
{{ . }}
{{- end }}
{{- end }}

{{- define "tandem.podSpecCommon" -}}
serviceAccountName: {{ include "tandem.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* nodeSelector, tolerations and affinity of one component's values */}}
{{- define "tandem.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A component's resources with its GPUs added to the limits: (dict "resources" ... "gpu" ... "count" N) */}}
{{- define "tandem.resources" -}}
{{- $resources := deepCopy (default (dict) .resources) }}
{{- if .gpu.enabled }}
{{- $limits := deepCopy (default (dict) $resources.limits) }}
{{- $_ := set $limits .gpu.resourceName (int .count) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* mode ray: every Ray pod mounts /tmp (Ray's session files), /dev/shm (its object store) and the models at the
same paths, since an actor may be placed on any pod of its group. */}}
{{- define "tandem.rayVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
{{- with (include "tandem.modelVolumeMount" . | trim) }}
{{ . }}
{{- end }}
{{- end }}

{{- define "tandem.rayVolumes" -}}
- name: tmp
  emptyDir: {}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ray.shmSizeLimit }}
{{- with (include "tandem.modelVolume" . | trim) }}
{{ . }}
{{- end }}
{{- end }}

{{/* A Prometheus Operator ServiceMonitor scraping /metrics on a component's Service port ("metrics" unless named),
with the endpoint's tlsConfig when given (an https scheme):
(dict "component" (dict "root" $ "component" "target") "settings" .Values.target.serviceMonitor "scheme" "http") */}}
{{- define "tandem.serviceMonitor" -}}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "tandem.componentName" .component }}
  labels:
    {{- include "tandem.componentLabels" .component | nindent 4 }}
    {{- with .settings.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" .component | nindent 6 }}
  endpoints:
    - port: {{ default "metrics" .port }}
      path: /metrics
      interval: {{ .settings.interval }}
      scheme: {{ .scheme }}
      {{- with .tlsConfig }}
      tlsConfig:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
